"""The 16-bit layers of ``kvcal calibrate --engine vllm --kv-cache-dtype D --skip-layers auto|0,1,...``.

vLLM 0.33 keeps the layers named in ``--kv-cache-dtype-skip-layers`` in the model dtype. ``kvcal calibrate``
records them in the artifact's ``vllm`` metadata section (``skip_layers``, and how they were chosen in
``skip_layers_choice``); ``kvcal export --target vllm`` prints them in the ``vllm serve`` line and the
disclosure report states them.

``--skip-layers auto`` chooses them the way ``kvcal recommend`` does for one dtype — the same code, not a
second path: :func:`kvcal.engines.vllm.probe.layer_sensitivity` (model-level KL when only layer ``l`` goes through
the dtype, with the scales just calibrated: :func:`kvcal.engines.vllm.probe.vllm_scales`) on the calibration
run's held-out samples, then :func:`kvcal.engines.vllm.skip_layers.budget_skip_layers` (exact 0/1 knapsack under
``--max-skip N`` and/or ``--max-bytes-per-token B``). Only the dtypes whose calibrated scales the probe can
read (:data:`AUTO_DTYPES`) take ``auto``; an explicit list is recorded for any dtype.
"""

from __future__ import annotations

from collections.abc import Callable

#: dtypes whose calibrated static scales :func:`choose_skip_layers_for_artifact` reads for the probe
#: (:func:`kvcal.engines.vllm.probe.vllm_scales`): FP8 k/v/q scales, NVFP4 outer scales and q_scale.
AUTO_DTYPES = ("fp8", "fp8_e4m3", "nvfp4")


def check_skip_config(engine: str | None, kv_cache_dtype: str | None, skip_layers, max_skip: int | None,
                      max_bytes_per_token: int | None) -> None:
    """Model-free checks of calibrate's ``--skip-layers`` / ``--max-skip`` / ``--max-bytes-per-token``
    (``skip_layers`` as :func:`kvcal.search.skip_layers.parse_skip_layers` returns it): they need
    ``--engine vllm``; ``auto`` needs a budget and a dtype in :data:`AUTO_DTYPES`; a budget needs
    ``auto``. Raises :class:`~kvcal.errors.KvcalError` with a one-line fix."""
    from kvcal.errors import KvcalError
    from kvcal.search.skip_layers import check_skip_options

    given = [o for o, v in (("--skip-layers", skip_layers), ("--max-skip", max_skip),
                            ("--max-bytes-per-token", max_bytes_per_token)) if v is not None]
    if given and engine != "vllm":
        raise KvcalError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} with --engine vllm "
                         "--kv-cache-dtype D (vLLM's --kv-cache-dtype-skip-layers); add them or drop "
                         f"{'it' if len(given) == 1 else 'them'}")
    check_skip_options(skip_layers, max_skip, max_bytes_per_token)
    if skip_layers == "auto" and kv_cache_dtype not in AUTO_DTYPES:
        raise KvcalError(f"--skip-layers auto with --kv-cache-dtype {kv_cache_dtype}: the probe reads calibrated "
                         f"{'/'.join(AUTO_DTYPES)} scales only; name the layers (--skip-layers 0,1,...) or use "
                         f"kvcal recommend --dtypes {kv_cache_dtype}")


def check_skip_model(skip_layers, kv_cache_dtype: str, model_config, max_skip: int | None,
                     max_bytes_per_token: int | None) -> None:
    """The checks that need the model's shape (``model_config``: a transformers config), run before the
    weights load: :func:`kvcal.engines.vllm.skip_layers.check_skip_layers`. Raises
    :class:`~kvcal.errors.KvcalError`."""
    from kvcal.engines.vllm.memory import vllm_token_shares
    from kvcal.engines.vllm.skip_layers import check_skip_layers
    from kvcal.formats.memory import model_shape

    if skip_layers is None:
        return
    shp = model_shape(model_config)
    check_skip_layers(skip_layers, kv_cache_dtype, shp.num_layers, shp.num_kv_heads, shp.head_dim,
                      max_skip=max_skip, max_bytes_per_token=max_bytes_per_token,
                      shares=vllm_token_shares(model_config))


def choose_skip_layers_for_artifact(model, samples: list, probe_meta: dict, tensors: dict, meta: dict,
                                    skip_layers, max_skip: int | None = None,
                                    max_bytes_per_token: int | None = None, progress: bool = True,
                                    log: Callable[[str], None] = print) -> list[int]:
    """Choose (``skip_layers == "auto"``) or take (a tuple of indices) the 16-bit layers of the artifact
    being written and record them in ``meta["vllm"]``: ``skip_layers`` (sorted, vLLM's own boundary layers
    of the dtype included) and ``skip_layers_choice`` = ``{"method": "auto"|"given", "max_skip",
    "max_bytes_per_token", "bytes_per_token", "bytes_per_token_16bit"}`` plus, for ``auto``, the per-layer
    ``sensitivity`` (KL, nats), the ``probe`` (``probe_meta``: source, samples, tokens) and the
    ``selection`` rule. ``samples``: int64 token tensors ``[T_i]`` of the probe (held-out calibration
    samples); ``tensors``/``meta``: the artifact's tensors and metadata with ``meta["vllm"]`` already
    written (:func:`kvcal.engines.vllm.search_fp8.add_to_artifact`). Bytes per token as
    :func:`kvcal.engines.vllm.dtypes.layer_bytes_per_token` counts vLLM's pages. Mutates ``meta``;
    returns the layers. Raises :class:`~kvcal.errors.KvcalError` when the probe has no samples."""
    from kvcal.engines.vllm.dtypes import boundary_skip_layers, layer_bytes_per_token
    from kvcal.engines.vllm.memory import vllm_bytes_per_token, vllm_token_shares
    from kvcal.engines.vllm.probe import layer_sensitivity, vllm_scales
    from kvcal.engines.vllm.section import vllm_section
    from kvcal.engines.vllm.skip_layers import budget_skip_layers
    from kvcal.errors import KvcalError
    from kvcal.formats.memory import model_shape

    dtype = vllm_section(meta).kv_cache_dtype
    shares = vllm_token_shares(model.config)  # None unless the model has sliding-window layers
    budget_ctx = model_shape(model.config).max_position_embeddings if shares is not None else None
    m = meta["model"]
    L, H, D = int(m["num_layers"]), int(m["num_kv_heads"]), int(m["head_dim"])
    choice: dict = {"method": "auto" if skip_layers == "auto" else "given", "max_skip": max_skip,
                    "max_bytes_per_token": max_bytes_per_token}
    if skip_layers == "auto":
        if not samples:
            raise KvcalError(f"--skip-layers auto: no {probe_meta.get('source', 'held-out')} sample of 3 or more "
                             "tokens fits --probe-tokens; raise --probe-tokens or name the layers")
        log(f"16-bit layers: per-layer sensitivity probe for {dtype} on {probe_meta.get('samples')} "
            f"{probe_meta.get('source')} samples ({probe_meta.get('tokens')} tokens; {1 + L} forward passes over each)")
        sens = layer_sensitivity(model, samples, dtype, L, progress=progress, **vllm_scales(dtype, tensors, meta, L))
        skip = budget_skip_layers(sens, dtype, L, H, D, max_skip=max_skip, max_bytes_per_token=max_bytes_per_token,
                                  shares=shares)
        choice.update(sensitivity=sens, probe=dict(probe_meta),
                      selection="exact 0/1 knapsack: the most summed per-layer KL under the budget "
                                "(kvcal.search.skip_layers.choose_skip_layers; ties: fewer, then lower layers)")
    else:
        skip = sorted(set(int(i) for i in skip_layers) | set(boundary_skip_layers(dtype, L)))
    if shares is None:
        per_layer = layer_bytes_per_token(dtype, L, H, D, skip)
        choice.update(bytes_per_token=int(sum(per_layer)),
                      bytes_per_token_16bit=int(sum(layer_bytes_per_token(dtype, L, H, D, range(L)))))
    else:  # sliding-window layers: bytes per token averaged over the model's maximum context
        choice.update(bytes_per_token=vllm_bytes_per_token(model.config, dtype, skip, context=budget_ctx),
                      bytes_per_token_16bit=vllm_bytes_per_token(model.config, dtype, range(L), context=budget_ctx),
                      bytes_per_token_context=budget_ctx)
    vm = meta["vllm"]  # the section being written (a dict): record the layers in place
    vm["skip_layers"] = list(skip)
    vm["skip_layers_choice"] = choice
    log(f"16-bit layers (--kv-cache-dtype-skip-layers): {', '.join(map(str, skip)) or 'none'}; "
        f"{choice['bytes_per_token']} KV bytes per token ({choice['bytes_per_token_16bit']} at 16 bits)")
    return list(skip)


__all__ = ["AUTO_DTYPES", "check_skip_config", "check_skip_model", "choose_skip_layers_for_artifact"]
