"""The Mixture-of-Attentions drafter (arXiv 2410.03804, sections 3-5).

Two halves, split at the client-server seam (docs/architecture.md):

- `ContextEncoder` runs next to the target. For every newly verified token it gathers the K/V of all
  target layers, runs Layer Self-Attention (LSA: one bidirectional decoder layer whose sequence is the
  L layers), averages over layers and projects to a context vector c_t of the target's hidden size.
- `MoADrafter` runs on the drafting side. Self-Attention (SA) is a causal decoder layer over the
  target's frozen token embeddings; Cross-Attention (CA) reads the cached context vectors of verified
  tokens only; Target Layer Inference (TLI, N in {0, 1, 3}) optionally runs the target's real last N
  layers on top; the frozen (optionally trimmed) LM head gives the draft distribution.

Alignment used everywhere (inference and training): row i of a sequence is the token x_i at absolute
position i. Its SA input is embed(x_i), its output predicts x_{i+1}, so it regresses the target's
hidden state of row i (the final normed state for N=0, the input of target layer L-N for N>0). The
context vector c_j is built from the target's K/V at slot j. At inference the root (the last emitted
token, position P) and every drafted node see the contexts c_0..c_{P-1} of the P verified tokens, so
in training row i sees c_j for j <= start_i where start_i < i is the last verified slot before i
(`verification_starts`). Trainable: SA, CA, LSA and the projection; everything else is the target's.
What it shares with the other trained drafters (target binding, trimmed head, checkpoints, drafting
masks) is in `drafters/trained.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from moaspec.decoding.context import register
from moaspec.decoding.scheduler import pause
from moaspec.decoding.target import DeferredContext, resolve_contexts
from moaspec.decoding.tree import Tree, TreeConfig, grow_tree
from moaspec.drafters.layers import (
    BlockKernels,
    CrossAttentionLayer,
    DecoderLayer,
    DraftLinear,
    FrozenTargetLayer,
    KVCache,
    rope,
)
from moaspec.drafters.trained import (
    TargetBoundConfig,
    TargetBoundDrafter,
    causal_mask,
    check_heads,
    pending_mask,
    place_frontier,
    read_checkpoint,
)
from moaspec.errors import UserError
from moaspec.models.parts import TargetParts
from moaspec.models.runtime import KVCache as TargetCache
from moaspec.models.runtime import ModelConfig, Transformer, rms_norm, signed_sin

KIND = "moa"


# ----------------------------------------------------------------------------- config
@dataclass
class MoAConfig(TargetBoundConfig):
    label = "MoA"
    target_dims = ("hidden_size", "num_layers", "num_kv_heads", "head_dim", "vocab_size")
    # the target this drafter belongs to
    target_name: str
    target_fingerprint: str
    hidden_size: int  # target hidden D (also the SA/CA hidden and the context-vector size)
    num_layers: int  # target L
    num_kv_heads: int  # target Hkv
    head_dim: int  # target d
    vocab_size: int  # target vocabulary
    # Self-Attention layer
    sa_heads: int
    sa_kv_heads: int
    sa_head_dim: int
    sa_mlp: int
    # Cross-Attention layer
    ca_heads: int
    ca_kv_heads: int
    ca_head_dim: int
    ca_mlp: int
    # Layer Self-Attention (hidden = 2 * Hkv * d)
    lsa_heads: int
    lsa_kv_heads: int
    lsa_head_dim: int
    lsa_mlp: int
    tli_layers: int = 0  # N: target layers run on top of the drafter (0, 1 or 3 in the paper)
    # not in the paper: the Cross-Attention's query rows also get a projection of the target's final
    # state of the last verified token (what EAGLE-2 reads), straight into their residual stream
    query_state: bool = False
    vocab_ids: int = 0  # size K of the trimmed LM head; 0 = the full vocabulary
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("sa", "ca", "lsa"):
            check_heads(f"MoA {name}", getattr(self, f"{name}_heads"), getattr(self, f"{name}_kv_heads"))
        if not 0 <= self.tli_layers <= self.num_layers:
            raise UserError(f"tli_layers must be in 0..{self.num_layers}, got {self.tli_layers}")
        self._check_vocab_ids()

    @property
    def lsa_hidden(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def for_target(
        cls,
        model_cfg: ModelConfig,
        tli_layers: int = 0,
        vocab_ids: int = 0,
        target_name: str = "",
        target_fingerprint: str = "",
        **overrides: Any,
    ) -> MoAConfig:
        """Sizes that scale with the target. For Llama-3-8B (hidden 4096, 32 heads, 8 KV heads of 128)
        this gives the paper's drafter: SA/CA hidden 4096 with 4 KV heads and MLP 6144, LSA hidden 2048
        (16 heads, 4 KV) with MLP 3072: 264M trainable parameters."""
        c = model_cfg

        def kv_heads(heads: int) -> int:  # the paper halves the target's 8 KV heads; small targets keep theirs
            kv = c.num_kv_heads // 2 if c.num_kv_heads >= 4 else c.num_kv_heads
            return kv if heads % kv == 0 else heads

        def mlp(hidden: int) -> int:  # ~1.5x hidden, a multiple of 64
            return max(64, round(1.5 * hidden / 64) * 64)

        lsa_heads = 2 * c.num_kv_heads
        sizes: dict[str, Any] = dict(
            sa_heads=c.num_heads, sa_kv_heads=kv_heads(c.num_heads), sa_head_dim=c.head_dim,
            sa_mlp=mlp(c.hidden_size),
            ca_heads=c.num_heads, ca_kv_heads=kv_heads(c.num_heads), ca_head_dim=c.head_dim,
            ca_mlp=mlp(c.hidden_size),
            lsa_heads=lsa_heads, lsa_kv_heads=kv_heads(lsa_heads), lsa_head_dim=c.head_dim,
            lsa_mlp=mlp(2 * c.num_kv_heads * c.head_dim),
        )
        sizes.update(overrides)
        return cls(
            target_name=target_name, target_fingerprint=target_fingerprint,
            hidden_size=c.hidden_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, vocab_size=c.vocab_size, tli_layers=tli_layers, vocab_ids=vocab_ids,
            rope_theta=c.rope_theta, rms_eps=c.rms_eps, **sizes,
        )


# ----------------------------------------------------------------------------- training masks
def verification_starts(T: int, prompt_len: int | torch.Tensor, every: int | torch.Tensor) -> torch.Tensor:
    """start[i]: the last verified slot whose context row i may read (arXiv 2410.03804, section 4).

    Verified slots ("verification points") are every prompt slot j < prompt_len and every j with
    j % every == 0. Row i (token x_i at position i) sees the contexts of slots j <= start[i], with
    start[i] = the last verification point strictly before i, as at inference, where the root at
    position P reads the contexts of the P verified slots 0..P-1. So rows 1..prompt_len read up to
    i - 1, and a generated row i reads up to max(prompt_len - 1, the last multiple of `every` below i):
    it drafts i - start[i] steps ahead (1 for a root, up to `every`). Row 0 has no earlier slot and
    gets 0 (keep it out of the loss; it is a prompt row anyway).

    prompt_len/every: ints (-> [T]) or [B] tensors (-> [B, T]); long tensor.
    """
    batched = isinstance(prompt_len, torch.Tensor) and prompt_len.dim() > 0 or (
        isinstance(every, torch.Tensor) and every.dim() > 0)
    p = torch.as_tensor(prompt_len, dtype=torch.long).reshape(-1, 1)
    e = torch.as_tensor(every, dtype=torch.long).reshape(-1, 1)
    if (e < 1).any() or (p < 1).any():
        raise ValueError("verification_starts needs every >= 1 and prompt_len >= 1")
    i = torch.arange(T, device=p.device)[None]
    multiple = (i - 1).clamp(min=0) // e * e
    start = torch.where(i <= p, i - 1, torch.maximum(p - 1, multiple)).clamp(min=0)
    return start if batched else start[0]


def ca_mask(start_idx: torch.Tensor) -> torch.Tensor:
    """[B, T] (or [T]) start indices -> bool [B, T, T] (or [T, T]): CA query i sees context j <= start_i."""
    j = torch.arange(start_idx.shape[-1], device=start_idx.device)
    return j <= start_idx[..., None]


def sa_curriculum_mask(start_idx: torch.Tensor) -> torch.Tensor:
    """Curriculum SA mask: query i sees only tokens j with start_i < j <= i, and itself."""
    T = start_idx.shape[-1]
    i = torch.arange(T, device=start_idx.device)
    j = i
    causal = j[None] <= i[:, None]
    return (causal & (j > start_idx[..., None])) | torch.eye(T, dtype=torch.bool, device=start_idx.device)


def tli_mask(start_idx: torch.Tensor) -> torch.Tensor:
    """bool [B, T, 2T] for the TLI layers in training: keys are the target's K/V of the T slots (query i
    sees j <= start_i) followed by the drafter's own K/V of the T rows (query i sees start_i < j <= i)."""
    return torch.cat([ca_mask(start_idx), sa_curriculum_mask(start_idx)], -1)


# ----------------------------------------------------------------------------- context encoder
@register
@dataclass
class MoAContext:
    """What the drafter receives per newly verified token (the payload of the client-server seam)."""

    kind: ClassVar[str] = "moa"
    vectors: torch.Tensor  # [n, D] context vectors c_t
    tail_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # target K, V of the last N layers [N, Hkv, n, d]
    state: torch.Tensor | None = None  # [1, D] the target's final state of the last of the n tokens (query_state)

    def __len__(self) -> int:
        return self.vectors.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"vectors": self.vectors}
        if self.tail_kv is not None:
            out["tail_k"], out["tail_v"] = self.tail_kv
        if self.state is not None:
            out["state"] = self.state
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> MoAContext:
        if "vectors" not in t or t["vectors"].dim() != 2 or ("tail_k" in t) != ("tail_v" in t):
            raise UserError(f"malformed MoA context: tensors {sorted(t)}")
        tail = (t["tail_k"], t["tail_v"]) if "tail_k" in t else None
        if tail is not None and not (tail[0].shape == tail[1].shape and tail[0].dim() == 4
                                     and tail[0].shape[2] == t["vectors"].shape[0]):
            raise UserError("malformed MoA context: the target K/V do not match the context vectors")
        state = t.get("state")
        if state is not None and state.shape != (1, t["vectors"].shape[1]):
            raise UserError("malformed MoA context: the final state does not match the context vectors")
        return cls(t["vectors"], tail, state)


class ContextEncoder(nn.Module):
    """Target side of MoA: Layer Self-Attention over all layers' K/V of a token, mean, projection."""

    def __init__(self, cfg: MoAConfig):
        super().__init__()
        self.cfg = cfg
        # the target's states `encode` reads: none (its KV cache only), or the final one (query_state)
        self.hidden_layers: tuple[int, ...] = (cfg.num_layers,) if cfg.query_state else ()
        E = cfg.lsa_hidden
        self.lsa = DecoderLayer(E, cfg.lsa_heads, cfg.lsa_kv_heads, cfg.lsa_head_dim, cfg.lsa_mlp, cfg.rms_eps)
        self.proj = DraftLinear(E, cfg.hidden_size, bias=True)
        cos, sin = rope(cfg.rope_theta, cfg.lsa_head_dim, cfg.num_layers)  # positions 0..L-1 = layers
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("sin_signed", signed_sin(sin), persistent=False)  # the inference path's table

    def layer_states(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [..., L, Hkv, d] -> LSA outputs [..., L, 2*Hkv*d] (before the mean over layers)."""
        lead, L = k.shape[:-3], k.shape[-3]
        x = torch.cat([k, v], -1).flatten(-2)  # per head [k_h, v_h]: [..., L, 2*Hkv*d]
        x = self.lsa(x.reshape(-1, L, x.shape[-1]), self.cos, self.sin)  # bidirectional: no mask
        return x.view(*lead, L, x.shape[-1])

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Training entry point: k, v [B, T, L, Hkv, d] (any leading dims; keys after RoPE, as cached)
        -> context vectors [B, T, D]."""
        return self.proj(self.layer_states(k, v).mean(-2))

    # tokens per LSA call on the inference path: a chunk's activations ([chunk * L, 2*Hkv*d] floats) stay
    # in the L2 cache, where one call over a long prompt allocates and streams them from memory
    CHUNK = 32

    @torch.no_grad()
    def encode(self, cache: TargetCache, slots: torch.Tensor, hidden: dict[int, torch.Tensor]) -> MoAContext:
        """The `decoding.target.ContextEncoder` protocol: context for newly committed cache slots.
        `forward` on the inference path: the LSA of every new token's L layer rows in batched calls
        (`DecoderLayer.infer`), the projection in the target's weight mode."""
        ids = slots.tolist()
        n = len(ids)
        if n and ids == list(range(ids[0], ids[0] + n)):
            slots = slice(ids[0], ids[0] + n)  # the usual case: a view, no gather
        K, V = cache.kv(slots)  # [L, Hkv, n, d]
        L, E = self.cfg.num_layers, self.cfg.lsa_hidden
        x = torch.cat([K, V], -1).permute(2, 0, 1, 3).reshape(n, L, E)  # per head [k_h, v_h], as `layer_states`
        kern, proj = self.lsa.kernels(), self.proj.kernel()
        chunks = []
        for s in range(0, n, self.CHUNK):
            if s:
                pause()  # a prompt's context a chunk at a time: a server's other sessions have their passes between
            chunks.append(proj(self.lsa.infer(x[s:s + self.CHUNK], self.cos, self.sin_signed, kern=kern).mean(-2)))
        chunks = chunks or [x.new_zeros(0, self.cfg.hidden_size)]
        vectors = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        N = self.cfg.tli_layers
        tail = (K[-N:].clone(), V[-N:].clone()) if N else None
        state = hidden[self.cfg.num_layers][-1:].clone() if self.cfg.query_state and n else None
        return MoAContext(vectors, tail, state)


# ----------------------------------------------------------------------------- drafter
@dataclass
class TrainOut:
    hidden: torch.Tensor  # [B, T, D] CA output: regresses the target's final state (N=0) or layer L-N input
    final: torch.Tensor  # [B, T, D] normed state fed to the LM head (after the TLI layers); `hidden` if N=0
    logits: torch.Tensor | None  # [B, T, K] over the drafter's vocabulary (`vocab_ids`), None if not asked


class MoADrafter(TargetBoundDrafter):
    """The drafting side of MoA; implements `decoding.drafter.Drafter`.

    Parameters (trainable): `sa`, `ca`, `encoder.lsa`, `encoder.proj`; buffer `vocab_ids` (kept target
    token ids of the trimmed head). Frozen target parts (embedding, LM head, final norm, last N layers)
    are shared with the target by `attach`/`from_target` and are not in the state dict.
    """

    name = "moa"
    config_cls = MoAConfig

    def __init__(self, cfg: MoAConfig, max_seq_len: int = 4096):
        super().__init__(cfg, max_seq_len)
        D = cfg.hidden_size
        self.sa = DecoderLayer(D, cfg.sa_heads, cfg.sa_kv_heads, cfg.sa_head_dim, cfg.sa_mlp, cfg.rms_eps)
        self.ca = CrossAttentionLayer(D, cfg.ca_heads, cfg.ca_kv_heads, cfg.ca_head_dim, cfg.ca_mlp, cfg.rms_eps)
        self.encoder = ContextEncoder(cfg)
        self.state_proj = DraftLinear(D, D, bias=False) if cfg.query_state else None
        for name, hd in (("sa", cfg.sa_head_dim), ("ca", cfg.ca_head_dim)):
            cos, sin = rope(cfg.rope_theta, hd, max_seq_len)
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)
            self.register_buffer(f"{name}_sin_signed", signed_sin(sin), persistent=False)  # inference path
        self.apply(self._init_weights)
        if self.state_proj is not None:  # at zero it is the paper's drafter: a fine-tune from one starts there
            nn.init.zeros_(self.state_proj.weight)
        # frozen target parts besides the embedding and LM head (attach)
        self.tli: list[FrozenTargetLayer] = []
        self.final_norm: torch.Tensor | None = None
        self.tli_cos = self.tli_sin = None
        self.reset()

    def attach(self, target: TargetParts) -> None:
        """Share the target's embedding, LM head, final norm and last N layers (no copies)."""
        super().attach(target)
        self.final_norm = target.norm
        N = self.cfg.tli_layers
        self.tli = [FrozenTargetLayer(layer, target.cfg) for layer in target.tail_layers(N)]
        self.tli_cos, self.tli_sin = target.cos, target.sin

    # ------------------------------------------------------------------ shared math
    def _after_sa(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        ca_k: torch.Tensor,
        ca_v: torch.Tensor,
        ca_attn: torch.Tensor | None,
        tli_kv: list[dict[str, Any]],
        tli_attn: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CA, then TLI layers and the final norm (N>0): returns (CA output, state for the LM head)."""
        h = self.ca(x, self.ca_cos[positions], self.ca_sin[positions], ca_k, ca_v, ca_attn)
        if not self.tli:
            return h, h
        out = h
        cos, sin = self.tli_cos[positions], self.tli_sin[positions]
        for layer, kv in zip(self.tli, tli_kv, strict=True):
            out = layer(out, cos, sin, tli_attn, **kv)
        return h, rms_norm(out, self.final_norm, self.cfg.rms_eps)

    # ------------------------------------------------------------------ training
    def forward_train(
        self,
        tokens: torch.Tensor,
        ctx_vectors: torch.Tensor,
        start_idx: torch.Tensor,
        tail_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        sa_mask: torch.Tensor | None = None,
        compute_logits: bool = True,
        ca_visible: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ) -> TrainOut:
        """One pass over whole sequences with the inference information limit built into the masks.

        tokens [B, T] target token ids (row i at position i); ctx_vectors [B, T, D] = ContextEncoder.forward
        of the target's K/V of the same T slots; start_idx [B, T] from `verification_starts` (CA row i
        reads contexts j <= start_i); tail_kv: the target's K, V of its last N layers, each
        [B, N, Hkv, T, d] (required iff N > 0); sa_mask: bool [T, T] or [B, T, T] for SA (default
        causal; `sa_curriculum_mask(start_idx)` for the curriculum); ca_visible: bool [B, T, T], the
        contexts each CA row reads, if not `ca_mask(start_idx)` (ablations); states [B, T, D]: the target's
        final states of the T slots (required iff query_state: row i reads slot start_i's). Row i's outputs
        predict x_{i+1}.
        """
        self._require_target()
        B, T = tokens.shape
        if start_idx.dim() == 1:
            start_idx = start_idx.expand(B, T)
        if bool(self.tli) != (tail_kv is not None):
            raise ValueError(f"tail_kv must be given exactly when tli_layers > 0 (N={self.cfg.tli_layers})")
        if self.tli and torch.is_grad_enabled() and not all(layer.trainable for layer in self.tli):
            raise UserError("training a TLI drafter needs the target's fp32 weights (load it with weights='fp32')")
        positions = torch.arange(T, device=tokens.device)
        x = self.embed[tokens]
        if sa_mask is None:
            sa_mask = causal_mask(T, tokens.device)
        x = self.sa(x, self.sa_cos[positions], self.sa_sin[positions], sa_mask)
        if self.state_proj is not None:
            if states is None:
                raise ValueError("this MoA drafter (query_state) needs the target's final states")
            x = x + self.state_proj(torch.gather(states, 1, start_idx[..., None].expand(-1, -1, states.shape[-1])))
        ca_k, ca_v = self.ca.context_kv(ctx_vectors, self.ca_cos[positions], self.ca_sin[positions])
        tli_kv = [dict(prefix=(tail_kv[0][:, n], tail_kv[1][:, n])) for n in range(len(self.tli))] if tail_kv else []
        hidden, final = self._after_sa(x, positions, ca_k, ca_v,
                                       ca_mask(start_idx) if ca_visible is None else ca_visible, tli_kv,
                                       tli_mask(start_idx) if self.tli else None)
        return TrainOut(hidden, final, self.logits(final) if compute_logits else None)

    # ------------------------------------------------------------------ inference (Drafter protocol)
    def reset(self) -> None:
        self.tokens: list[int] = []  # committed tokens (prompt + accepted), all in the target's cache
        self.sa_len = 0  # tokens whose K/V are in the SA cache
        self.ctx_len = 0  # verified tokens whose CA keys/values (and TLI K/V) are cached
        self.deferred: list[DeferredContext] = []  # contexts to encode before the next draft
        self.state_vec: torch.Tensor | None = None  # query_state: the projected last verified final state

    def _allocate(self) -> None:
        S = self.max_seq_len
        p = next(self.parameters())
        if getattr(self, "sa_cache", None) is not None and self.sa_cache.size == S:
            return
        c, tc = self.cfg, self.target_cfg
        self.sa_cache = KVCache(c.sa_kv_heads, S, c.sa_head_dim, p.device, p.dtype)
        self.ca_cache = KVCache(c.ca_kv_heads, S, c.ca_head_dim, p.device, p.dtype)
        self.tli_caches = [KVCache(tc.num_kv_heads, S, tc.head_dim, p.device, p.dtype) for _ in self.tli]

    def _add_context(self, context: Any) -> None:
        """Project CA keys/values (and store the TLI K/V) once for each newly verified token."""
        if isinstance(context, DeferredContext):
            self.deferred.append(context)
            return
        if not isinstance(context, MoAContext):
            raise UserError("the MoA drafter needs MoA context from the target: pass drafter.encoder to the target")
        start, n = self.ctx_len, len(context)
        if start + n > self.max_seq_len:
            raise UserError(f"MoA drafter context full ({start} + {n} > {self.max_seq_len} tokens)")
        k, v = self.ca.context_kv_infer(context.vectors[None], self.ca_cos[start:start + n],
                                        self.ca_sin_signed[start:start + n])
        self.ca_cache.update(start, k, v)
        for i, cache in enumerate(self.tli_caches):
            cache.update(start, context.tail_kv[0][i][None], context.tail_kv[1][i][None])
        if self.state_proj is not None and n:
            if context.state is None:
                raise UserError("this MoA drafter reads the target's final state: the target sent none")
            self.state_vec = self.state_proj.kernel()(context.state)
        self.ctx_len += n

    def _embed_rows(self, ids: list[int]) -> torch.Tensor:
        """The frozen embeddings of token ids as SA input [1, n, D] (one row: a view, no gather)."""
        if len(ids) == 1:
            return self.embed[ids[0]:ids[0] + 1][None]
        return self.embed[torch.tensor(ids, device=self.embed.device)][None]

    def _predict(self, x: torch.Tensor, positions: slice | torch.Tensor, start: int, mask: torch.Tensor | None,
                 ca: BlockKernels) -> torch.Tensor:
        """SA outputs x [1, n, D] of rows at `positions` (a slice: all rows at one position, or one per row)
        -> log-probs [n, K]. The TLI layers write the rows' own K/V at tentative slots [start, start + n)
        after the verified ones and attend under `mask`. `_after_sa` on the inference path."""
        L = self.ctx_len
        if self.state_vec is not None:
            x = x + self.state_vec
        out = self.ca.infer(x, self.ca_cos[positions], self.ca_sin_signed[positions], self.ca_cache.k[:, :, :L],
                            self.ca_cache.v[:, :, :L], ca)
        if self.tli:
            cos, sin = self.tli_cos[positions], self.tli_sin[positions]
            for layer, cache in zip(self.tli, self.tli_caches, strict=True):
                out = layer(out, cos, sin, mask, cache=cache, start=start)
            out = rms_norm(out, self.final_norm, self.cfg.rms_eps)
        return torch.log_softmax(self._fast_head(out[0]), -1)

    @torch.no_grad()
    def catch_up(self) -> None:
        """Encode and take in the contexts the target deferred (`decoding.target.DeferredContext`)."""
        if self.deferred:
            pending, self.deferred = self.deferred, []
            for ctx in resolve_contexts(pending):
                self._add_context(ctx)

    def propose(self, root: int, cfg: TreeConfig) -> Tree:
        self.catch_up()
        P = len(self.tokens)  # the root's position; the target has verified slots 0..P-1
        if self.ctx_len > P:
            raise RuntimeError(f"MoA drafter out of step: {P} committed tokens but {self.ctx_len} context vectors")
        # ctx_len < P only while the target is away: the tokens written since have no context vector, and
        # CA reads the verified ones (as in training, where a row reads contexts up to its last verified slot)
        if P + 1 + cfg.depth * cfg.topk > self.max_seq_len:
            return Tree.chain(root)
        dev = self.sa_cos.device
        sa, ca = self.sa.kernels(), self.ca.kernels()  # the inference kernels, checked once per round
        # SA over the tokens accepted since the last round + the root, in one causal pass (root committed:
        # it will be in the target's cache after verification). Only the root row goes on.
        start = min(self.sa_len, P)  # P: the same root again (its verification never came back)
        pending = [*self.tokens[start:], root]
        x = self.sa.infer(self._embed_rows(pending), self.sa_cos[start:P + 1],
                          self.sa_sin_signed[start:P + 1], pending_mask(start, len(pending), dev), self.sa_cache,
                          start, sa)
        self.sa_len = P + 1
        root_lp = self._predict(x[:, -1:], slice(P, P + 1), P, None, ca)[0]  # TLI: the root's own K/V at slot P

        # Drafted nodes get tentative slots P+1, P+2, ... (in frontier order) in the SA and TLI caches
        # (overwritten next round).
        slot_of = {0: P}

        def expand(tree: Tree, frontier: list[int]) -> torch.Tensor:
            # rows see the verified tokens and the root (slots 0..P), their ancestors and themselves
            depths = {tree.depths[node] for node in frontier}
            first = max(slot_of.values()) + 1
            if len(frontier) == 1 and depths == {first - P}:
                # a chain: the node's depth - 1 ancestors fill the tentative slots P+1..first-1, so it
                # sees every slot up to its own: no mask
                slot_of[frontier[0]] = first
                mask = None
            else:
                first, mask = place_frontier(tree, frontier, slot_of, P + 1, dev)
            if len(depths) == 1:  # a level of the tree: one position for all rows (a view of the tables)
                depth = depths.pop()
                positions: slice | torch.Tensor = slice(P + depth, P + depth + 1)
            else:
                positions = torch.tensor([P + tree.depths[node] for node in frontier], device=dev)
            x = self.sa.infer(self._embed_rows([tree.tokens[node] for node in frontier]), self.sa_cos[positions],
                              self.sa_sin_signed[positions], mask, self.sa_cache, first, sa)
            return self._predict(x, positions, first, mask, ca)

        return grow_tree(root, root_lp, expand, cfg, vocab=self.draft_vocab)


# ----------------------------------------------------------------------------- checkpoints
DRAFTER = MoADrafter  # what `DrafterSpec` saves and loads (drafters/__init__.py)


def load_encoder(folder: str | Path, target: Transformer, target_name: str, fingerprint: str) -> ContextEncoder:
    """The target-side half of a MoA checkpoint alone (Layer Self-Attention + projection), for a server."""
    cfg, tensors = read_checkpoint(folder, KIND, MoAConfig, target.cfg, target_name, fingerprint, target.device)
    encoder = ContextEncoder(cfg).to(target.device)
    prefix = "encoder."
    try:
        encoder.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    except RuntimeError as e:
        raise UserError(f"{folder}: the MoA encoder's weights do not match its config: {e}") from None
    encoder.eval()
    for m in encoder.modules():
        if isinstance(m, DraftLinear):
            m.mode = target.weights
    return encoder


def param_count(cfg: MoAConfig) -> int:
    """Trainable parameters of a drafter with these sizes (no memory used)."""
    return MoADrafter.param_count(cfg)


__all__ = [
    "ContextEncoder",
    "FrozenTargetLayer",
    "MoAConfig",
    "MoAContext",
    "MoADrafter",
    "TrainOut",
    "ca_mask",
    "causal_mask",
    "load_encoder",
    "param_count",
    "sa_curriculum_mask",
    "tli_mask",
    "verification_starts",
]
