"""Attention-visible error objectives, computed on real captured sequences (torch only).

Shapes for one layer and one sequence: ``q [H_q, T, D]`` (post-RoPE queries, all heads),
``k, v [H_kv, T, D]`` (post-RoPE keys and values as cached). Query head ``j`` reads KV head
``j // (H_q // H_kv)`` (GQA). Scores are ``s_ij = q_i·k_jᵀ · scaling`` for ``j <= i`` (causal),
``P = softmax(s)`` over the visible keys, ``O = P·V``. Quantized tensors wear a hat.

* **Keys — attention KL** (nats; what the model sees, since key error acts *before* softmax)::

      KL_i = Σ_j P_ij (log P_ij − log P̂_ij),   P̂ = softmax(q·k̂ᵀ·scaling)

  summed over the query heads of each KV head's group and the evaluated query positions.
  Source: the attention-KL criterion of KVQuant's / HeadQ's analyses; kvcal uses it as the
  primary key objective (``shared/docs/prior-art.md``, "Attention-visible error").
* **Keys — centered score error** (cheaper proxy)::

      Δs_ij = q_i·(k̂_j − k_j)ᵀ·scaling,   e = Σ_i Σ_{j<=i} (Δs_ij − mean_{j'<=i} Δs_ij')²

  softmax ignores a per-query constant, so the mean over the visible keys is removed (HeadQ /
  SMAQ 2026). To second order ``KL_i ≈ ½ Var_{P_i}(Δs_i)``; this proxy weights keys uniformly.
* **Keys — output error** (used by bit allocation, same unit as the value objective)::

      e = Σ_i ‖(P̂_i − P_i)·V‖² / Σ_i ‖P_i·V‖²

* **Values — attention-output error** (value error enters after softmax, through the weighted
  sum; weights ∝ P², SMAQ/HeadQ)::

      e = Σ_i ‖P_i·(V̂ − V)‖² / Σ_i ‖P_i·V‖²

* **Tensor MSE**: ``Σ (x̂ − x)² / Σ x²``, kept only as a comparison (llm-compressor's ``mse``
  observer minimizes ``Σ|x̂ − x|^2.4``; ModelOpt's weight MSE search).

Errors are returned as per-KV-head *sums* with their normalizers, so errors over the whole
calibration split are summed before any choice (never an average of per-batch optima).
:meth:`SequenceCache.head` gives a one-KV-head view, so per-head scalar searches cost ``1/H_kv``.
"""

from __future__ import annotations

import torch


def query_positions(T: int, max_queries: int | None) -> torch.Tensor:
    """Evaluated query positions: all ``T`` if ``max_queries`` is None or ``>= T``, else
    ``max_queries`` evenly spaced positions (always including the last). int64 ``[Tq]``."""
    if max_queries is None or max_queries >= T:
        return torch.arange(T)
    return torch.linspace(0, T - 1, max_queries).round().long().unique()


def _group(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``[H_q, ...] -> [H_kv, G, ...]`` grouping query heads by the KV head they read."""
    return q.reshape(h_kv, q.shape[0] // h_kv, *q.shape[1:])


def visible_mask(T: int, qpos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """``[Tq, T]`` bool, True where query position ``i`` may NOT read key position ``j``: ``j > i`` (causal)
    and, for a sliding-window layer (``window`` ``W > 0``), ``i - j >= W`` — transformers'
    ``masking_utils.sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``): the current token and
    the ``W - 1`` before it. ``window`` 0: full attention."""
    j = torch.arange(T, device=qpos.device)[None, :]
    i = qpos[:, None]
    mask = j > i
    if window:
        mask |= (i - j) >= window
    return mask


def causal_scores(q: torch.Tensor, k: torch.Tensor, scaling: float, qpos: torch.Tensor,
                  window: int = 0) -> torch.Tensor:
    """Masked scores ``[H_kv, G, Tq, T]`` (float32; ``-inf`` where the query may not read the key:
    :func:`visible_mask`, causal and, when ``window`` > 0, outside the layer's sliding window)."""
    h_kv, T = k.shape[0], k.shape[1]
    qg = _group(q[:, qpos].float(), h_kv)  # [H_kv, G, Tq, D]
    s = torch.einsum("hgqd,htd->hgqt", qg, k.float()) * scaling
    mask = visible_mask(T, qpos.to(s.device), window)  # [Tq, T], on the scores' device
    return s.masked_fill(mask, float("-inf"))


def centered_score_error(scores_ref: torch.Tensor, scores_hat: torch.Tensor) -> torch.Tensor:
    """Σ over visible (query, key) of the squared score error minus its per-query mean; ``[H_kv]`` f64."""
    vis = torch.isfinite(scores_ref)
    d = torch.where(vis, scores_hat - scores_ref, torch.zeros_like(scores_ref))
    n = vis.sum(-1, keepdim=True).clamp_min(1)
    d = torch.where(vis, d - d.sum(-1, keepdim=True) / n, d)
    return (d * d).sum(dim=(1, 2, 3)).double()


def output_error(p: torch.Tensor, v: torch.Tensor, v_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention-output error per KV head: ``(Σ‖P·(V̂−V)‖², Σ‖P·V‖²)``, each float64 ``[H_kv]``.

    ``p`` ``[H_kv, G, Tq, T]`` exact attention weights; ``v``, ``v_hat`` ``[H_kv, T, D]``.
    """
    o = torch.einsum("hgqt,htd->hgqd", p, v.float())
    do = torch.einsum("hgqt,htd->hgqd", p, (v_hat.float() - v.float()))
    return (do * do).sum(dim=(1, 2, 3)).double(), (o * o).sum(dim=(1, 2, 3)).double()


def tensor_mse(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Σ (x̂ − x)² per head for ``[H, T, D]`` tensors, float64 ``[H]``."""
    d = x_hat.double() - x.double()
    return (d * d).sum(dim=(1, 2))


class SequenceCache:
    """Per-sequence exact quantities reused across candidates: masked scores, log-probs, P.

    Built once per (layer, sequence); holds ``[H_kv, G, Tq, T]`` float32 tensors. ``window``: the layer's
    sliding window ``W`` (0: full attention); every quantity then reads only the keys the model's
    attention reads (:func:`visible_mask`), so a sliding layer's objective never counts keys its cache
    has dropped.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                 max_queries: int | None = 128, window: int = 0):
        self.q, self.k, self.v, self.scaling, self.window = q, k, v, scaling, int(window or 0)
        self.qpos = query_positions(k.shape[1], max_queries)
        self.scores = causal_scores(q, k, scaling, self.qpos, self.window)
        self.logp = torch.log_softmax(self.scores, dim=-1)
        self.p = self.logp.exp()
        self.num_queries = self.qpos.numel() * (q.shape[0] // k.shape[0])  # per KV head
        self._derive()

    def _derive(self) -> None:
        """Quantities shared by every candidate: the causal mask, ``Σ p·log p`` and ``Σ‖P·V‖²``."""
        self.masked = ~torch.isfinite(self.scores)  # [H_kv, G, Tq, T]
        self.logp0 = self.logp.masked_fill(self.masked, 0.0)
        o = torch.einsum("hgqt,htd->hgqd", self.p, self.v.float())
        self.out_sq = (o * o).sum(dim=(1, 2, 3)).double()

    def key_kl(self, k_hat: torch.Tensor) -> torch.Tensor:
        """``Σ KL(P ‖ P̂)`` per KV head (nats, float64 ``[H_kv]``) with keys ``k_hat`` ``[H_kv, T, D]``:
        :meth:`scores_kl` of ``(q · k_hatᵀ) · scaling`` over the evaluated queries."""
        qg = self.q[:, self.qpos].float().reshape(self.k.shape[0], -1, self.qpos.numel(), self.q.shape[-1])
        return self.scores_kl(torch.einsum("hgqd,htd->hgqt", qg, k_hat.float()).mul_(self.scaling))

    def scores_kl(self, s: torch.Tensor) -> torch.Tensor:
        """The one attention-level KL: ``Σ KL(P ‖ softmax(s))`` per KV head (nats, float64 ``[H_kv]``) over the
        evaluated queries, for unmasked scores ``s`` ``[H_kv, G, Tq, T]`` float32 (overwritten: masked in
        place); ``P`` the exact attention, masked keys (causal, sliding window) contributing nothing.
        Callers build ``s`` their way (quantized keys: :meth:`key_kl`; vLLM's folded q/k scales:
        :func:`kvcal.engines.vllm.search_fp8.joint_key_kl`)."""
        s = s.masked_fill_(self.masked, float("-inf"))
        logp_hat = torch.log_softmax(s, dim=-1).masked_fill_(self.masked, 0.0)
        return (self.p * (self.logp0 - logp_hat)).sum(dim=(1, 2, 3)).double()

    def key_centered(self, k_hat: torch.Tensor) -> torch.Tensor:
        return centered_score_error(self.scores, causal_scores(self.q, k_hat, self.scaling, self.qpos, self.window))

    def value_error(self, v_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Σ‖P·(V̂−V)‖², Σ‖P·V‖²)`` per KV head, as :func:`output_error` (reference cached)."""
        do = torch.einsum("hgqt,htd->hgqd", self.p, v_hat.float() - self.v.float())
        return (do * do).sum(dim=(1, 2, 3)).double(), self.out_sq

    def key_output_error(self, k_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Σ‖(P̂−P)·V‖², Σ‖P·V‖²)`` per KV head (float64 ``[H_kv]``) for quantized keys."""
        p_hat = torch.softmax(causal_scores(self.q, k_hat, self.scaling, self.qpos, self.window), dim=-1)
        o = torch.einsum("hgqt,htd->hgqd", self.p, self.v.float())
        do = torch.einsum("hgqt,htd->hgqd", p_hat - self.p, self.v.float())
        return (do * do).sum(dim=(1, 2, 3)).double(), (o * o).sum(dim=(1, 2, 3)).double()

    def head(self, h: int) -> SequenceCache:
        """A view restricted to KV head ``h`` (and its query group); no recomputation."""
        g = self.q.shape[0] // self.k.shape[0]
        out = object.__new__(SequenceCache)
        out.q, out.k, out.v, out.scaling = self.q[h * g : (h + 1) * g], self.k[h : h + 1], self.v[h : h + 1], self.scaling
        out.window = self.window
        out.qpos, out.scores, out.logp, out.p = self.qpos, self.scores[h : h + 1], self.logp[h : h + 1], self.p[h : h + 1]
        out.num_queries = self.num_queries
        out.masked, out.logp0, out.out_sq = self.masked[h : h + 1], self.logp0[h : h + 1], self.out_sq[h : h + 1]
        return out


def sequence_caches(reservoir, layer: int, scaling: float, max_queries: int | None,
                    window: int = 0) -> list[SequenceCache]:
    """One :class:`SequenceCache` per captured sequence of ``reservoir`` at ``layer``.

    ``reservoir``: a :class:`kvcal.capture.reservoir.SequenceReservoir` whose ``sequences()`` yield, per
    sequence, per layer ``(q [H_q, T, D], k [H_kv, T, D], v [H_kv, T, D])`` float32 post-RoPE tensors;
    ``scaling``: the layer's softmax scale (1/sqrt(head_dim) unless the model says otherwise);
    ``max_queries``: query positions evaluated per sequence (:func:`query_positions`); ``window``: the layer's
    sliding window (``CaptureResult.windows``; 0: full attention)."""
    return [SequenceCache(*seq[layer], scaling, max_queries, window) for seq in reservoir.sequences()]
