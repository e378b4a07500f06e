"""Report figures (matplotlib, object API, Agg-safe). Drawing only: every input comes ready-made
from :mod:`kvcal.report.data`; each function returns a ``matplotlib.figure.Figure`` (or ``None``
when there is nothing to draw) and never touches pyplot's global state."""

from __future__ import annotations

SIDE_TITLES = {"k": "keys", "v": "values"}
ERROR_UNITS = {"k": "attention KL (nats/query)", "v": "relative output error"}
COLORS = {"chosen": "tab:green", "absmax": "tab:blue", "unity": "tab:red", "min/max": "tab:blue"}


def _figure(ncols: int, nrows: int = 1, width: float = 5.2, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _int_axis(axis) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def _context_axis(ax, xs) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ticks = sorted(set(xs))
    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())


def fig_to_png(fig, dpi: int = 100) -> bytes:
    """PNG bytes of ``fig``; its ``Software`` text chunk names kvcal (:data:`kvcal.outputs.PNG_SOFTWARE`),
    which is how ``kvcal report`` knows the file as its own."""
    import io

    from kvcal import __version__
    from kvcal.outputs import PNG_SOFTWARE

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": f"{PNG_SOFTWARE}{__version__} (matplotlib)"})
    return buf.getvalue()


def plot_kv_ranges(ranges: dict | None):
    """Per-layer / per-head (per-channel when stored) absmax of keys and values, outliers marked.

    ``ranges``: :func:`kvcal.report.data.layer_ranges`."""
    if not ranges:
        return None
    from matplotlib.colors import LogNorm

    sides = [s for s in ("k", "v") if s in ranges and (ranges[s]["amax"] or ranges[s]["channel_absmax"])]
    if not sides:
        return None
    fig, axes = _figure(len(sides), width=6.0, height=4.2)
    for ax, side in zip(axes[0], sides, strict=True):
        r = ranges[side]
        title = f"{SIDE_TITLES[side]}: calibration absmax"
        if r["channel_absmax"] is not None:
            img = [[x for head in layer for x in head] for layer in r["channel_absmax"]]  # [L, H*D]
            D = len(r["channel_absmax"][0][0])
            H = len(r["channel_absmax"][0])
            pos = [x for row in img for x in row if x > 0]
            im = ax.imshow(img, aspect="auto", interpolation="nearest", cmap="viridis",
                           norm=LogNorm(vmin=min(pos), vmax=max(pos)) if pos else None)
            for h in range(1, H):
                ax.axvline(h * D - 0.5, color="white", lw=0.8)
            if r["outliers"]:
                ax.scatter([h * D + d for _, h, d in r["outliers"]], [i for i, _, _ in r["outliers"]],
                           marker="x", s=18, color="red", label=f"outlier channels ({len(r['outliers'])})")
                ax.legend(loc="upper right", fontsize=7)
            ax.set_xlabel(f"head x channel ({H} x {D})")
            ax.set_ylabel("layer")
            _int_axis(ax.yaxis)
            _int_axis(ax.xaxis)
            fig.colorbar(im, ax=ax, label="absmax")
            title += " per channel"
        elif max(len(a) for a in r["amax"]) > 1:
            im = ax.imshow(r["amax"], aspect="auto", interpolation="nearest", cmap="viridis")
            if r["outliers"]:
                ax.scatter([h for _, h, _ in r["outliers"]], [i for i, _, _ in r["outliers"]], marker="x", s=40,
                           color="red", label=f"outlier heads ({len(r['outliers'])})")
                ax.legend(loc="upper right", fontsize=7)
            ax.set_xlabel("KV head")
            ax.set_ylabel("layer")
            _int_axis(ax.yaxis)
            _int_axis(ax.xaxis)
            fig.colorbar(im, ax=ax, label="absmax")
            title += " per head\n(per-channel ranges not stored in this artifact)"
        else:
            vals = [a[0] if a else 0.0 for a in r["amax"]]
            out = {i for i, _, _ in r["outliers"]}
            ax.bar(range(len(vals)), vals, color=["red" if i in out else "tab:blue" for i in range(len(vals))])
            ax.set_xlabel("layer")
            _int_axis(ax.xaxis)
            ax.set_ylabel("absmax")
            ax.set_yscale("log")
            title += " per layer (red: outlier layers)\n(per-head/channel ranges not stored in this artifact)"
        ax.set_title(title, fontsize=9)
    return fig


def plot_clip_vs_absmax(ranges: dict | None):
    """Chosen clip threshold (value mapped to the format maximum) vs observed absmax, per layer."""
    if not ranges:
        return None
    sides = [s for s in ("k", "v") if s in ranges and (ranges[s]["clip"] or ranges[s]["clip_ratio"])]
    if not sides:
        return None
    fig, axes = _figure(len(sides))
    for ax, side in zip(axes[0], sides, strict=True):
        r = ranges[side]
        if not r["clip"]:  # dynamic side: the clip is a fraction of each group's own range
            L, nh = len(r["clip_ratio"]), max(len(c) for c in r["clip_ratio"])
            for h in range(nh):
                ax.plot(range(L), [c[h] if h < len(c) else float("nan") for c in r["clip_ratio"]], "s--", ms=3,
                        color=f"C{h % 10}", label=f"chosen clip ratio{f' head {h}' if nh > 1 else ''}")
            ax.axhline(1.0, color="black", lw=1, label="group absmax / min-max (ratio 1)")
            ax.set_xlabel("layer")
            _int_axis(ax.xaxis)
            ax.set_ylabel("clip ratio of the per-group range")
            ax.set_title(f"{SIDE_TITLES[side]}: chosen clip vs absmax (dynamic scales, relative)", fontsize=9)
            ax.legend(fontsize=7, ncol=2 if nh > 1 else 1)
            continue
        L = len(r["amax"])
        nh = max(len(a) for a in r["amax"])
        for h in range(nh):
            lab = f" head {h}" if nh > 1 else ""
            ax.plot(range(L), [a[h] if h < len(a) else float("nan") for a in r["amax"]], "o-", ms=3,
                    color=f"C{h % 10}", label=f"absmax{lab}")
            ax.plot(range(L), [c[h] if h < len(c) else float("nan") for c in r["clip"]], "s--", ms=3,
                    color=f"C{h % 10}", alpha=0.7, label=f"chosen clip{lab}")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        _int_axis(ax.xaxis)
        ax.set_ylabel("|x| (log)")
        ax.set_title(f"{SIDE_TITLES[side]}: chosen clip vs absmax", fontsize=9)
        ax.legend(fontsize=7, ncol=2 if nh > 1 else 1)
    return fig


def plot_layer_errors(heldout: dict | None, per_layer_eval: dict | None = None, data_word: str = "held-out"):
    """Per-layer error before/after: calibration held-out error of the chosen scale vs absmax vs
    unity (top row) and, when given, the evaluation's per-layer K attention KL / V output error
    per method (bottom row). ``data_word``: what the calibration errors were measured on
    (``"calibration-data"`` when there was no held-out split)."""
    if not heldout and not per_layer_eval:
        return None
    rows = [x for x in (heldout, per_layer_eval) if x]
    fig, axes = _figure(2, len(rows))
    r = 0
    if heldout:
        for ax, side in zip(axes[r], ("k", "v"), strict=True):
            for which, ys in (heldout.get(side) or {}).items():
                ax.plot(range(len(ys)), ys, "o-", ms=3, color=COLORS.get(which), label=which)
            ax.set_yscale("log")
            ax.set_xlabel("layer")
            _int_axis(ax.xaxis)
            ax.set_ylabel(ERROR_UNITS[side])
            ax.set_title(f"{SIDE_TITLES[side]}: {data_word} error (calibration domain)", fontsize=9)
            if heldout.get(side):
                ax.legend(fontsize=7)
        r += 1
    if per_layer_eval:
        for ax, side, key in zip(axes[r], ("k", "v"), ("k_attention_kl", "v_output_error"), strict=True):
            n = 0
            for i, (method, d) in enumerate(per_layer_eval.items()):
                ys = (d or {}).get(key)
                if ys:
                    ax.plot(range(len(ys)), ys, "o-", ms=3, color=f"C{i % 10}", label=method)
                    n += 1
            ax.set_yscale("log")
            ax.set_xlabel("layer")
            _int_axis(ax.xaxis)
            ax.set_ylabel(ERROR_UNITS[side])
            ax.set_title(f"{SIDE_TITLES[side]}: per-layer error on the evaluation corpus", fontsize=9)
            if n:
                ax.legend(fontsize=7)
    return fig


def plot_quality_vs_context(series: dict[str, dict] | None):
    """Quality vs context: one panel per metric, one line per method/mode.

    ``series``: metric name -> :func:`kvcal.report.data.quality_series` output."""
    series = {m: s for m, s in (series or {}).items() if s}
    if not series:
        return None
    fig, axes = _figure(len(series))
    for ax, (metric, s) in zip(axes[0], series.items(), strict=True):
        for i, (label, (xs, ys)) in enumerate(sorted(s.items())):
            style = "--" if "decode" in label else "-"
            ax.plot(xs, ys, style, marker="o", ms=4, color=f"C{i % 10}", label=label)
        _context_axis(ax, [x for xs, _ in s.values() for x in xs])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(metric)
        if metric.startswith("kl"):
            ax.set_yscale("symlog", linthresh=1e-5)
            if all(y >= 0 for _, ys in s.values() for y in ys):
                ax.set_ylim(bottom=0)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(f"{metric} vs context (dashed: decode mode)", fontsize=9)
        ax.legend(fontsize=6)
    return fig


def plot_memory(mem: dict | None, label: str = "this artifact"):
    """Cache bytes vs context for each batch: this artifact (solid) vs 16-bit (dashed), GiB.

    ``mem``: :func:`kvcal.report.data.memory_summary`."""
    if not mem:
        return None
    fig, axes = _figure(1, width=6.5, height=4.0)
    ax = axes[0][0]
    xs = mem["contexts"]
    for i, b in enumerate(mem["batches"]):
        ax.plot(xs, [v / 2**30 for v in mem["cache_bytes"][b]], "o-", ms=3, color=f"C{i % 10}",
                label=f"{label}, batch {b}")
        ax.plot(xs, [v / 2**30 for v in mem["cache_bytes_16"][b]], "--", color=f"C{i % 10}", alpha=0.6,
                label=f"16-bit, batch {b}")
    _context_axis(ax, xs)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("KV cache (GiB)")
    ax.set_title(f"KV-cache memory vs context x batch ({mem['ratio']:.2f}x smaller than 16-bit)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return fig
