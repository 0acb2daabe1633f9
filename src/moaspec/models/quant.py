"""Weight-only int8 and int4 quantisation, and the compiled kernels that multiply with it.

Plain decoding streams every weight once per token, so its speed is bytes per weight: fp16 moves 2,
int8 1, int4 (group 32, fp16 scale and offset) 0.625. Multiplying int8 weights in float arithmetic is
compute-bound on a 2-core AVX2 CPU and only ties fp16, so the kernels (`qgemm.cpp`) do what
llama.cpp does: the activations are quantised to int8 in blocks of 32 values (an outlier only coarsens
its own block, unlike the per-tensor dynamic int8 that broke these models) and multiplied with
integer dot products, each weight block read once for all rows.

The extension is compiled on first use with the machine's own C++ compiler (`-march=native`), kept
under the model cache and rebuilt when the source, torch or the CPU changes. Where it cannot be built
(no compiler, no AVX2) `kernels()` says why and the caller falls back to fp16 weights.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
from functools import cache
from pathlib import Path

import torch

from moaspec.errors import UserError

SOURCE = Path(__file__).with_name("qgemm.cpp")
BLOCK = 32  # activation block and the smallest int4 group
INT4_GROUPS = (32, 64, 128)
log = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@cache
def kernels():
    """The compiled extension, or raise `UserError` saying why it is unavailable."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise UserError(f"the int8/int4 kernels need an x86-64 CPU with AVX2, not {platform.machine()}; "
                        "use --weights fp16")
    flags = cpu_flags()
    if flags and not {"avx2", "fma", "f16c"} <= flags:
        raise UserError("the int8/int4 kernels need AVX2, FMA and F16C, which this CPU lacks; use --weights fp16")
    from torch.utils import cpp_extension

    from moaspec.models.store import cache_dir

    # MOASPEC_QGEMM_ARCH=avx2 builds the plain AVX2 kernels on a CPU that has more (to test that path)
    arch = ["-mavx2", "-mfma", "-mf16c"] if os.environ.get("MOASPEC_QGEMM_ARCH") == "avx2" else ["-march=native"]
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(sorted(flags) + arch).encode())
    build = cache_dir() / "ext" / f"qgemm-{key.hexdigest()[:12]}"
    build.mkdir(parents=True, exist_ok=True)
    name = f"moaspec_qgemm_{key.hexdigest()[:12]}"
    for attempt in range(2):
        try:
            # (a retry needs a new module name: torch skips the build of a name it has loaded before)
            return cpp_extension.load(
                name=name if attempt == 0 else f"{name}_rebuilt", sources=[str(SOURCE)], build_directory=str(build),
                extra_cflags=["-O3", *arch, "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=bool(os.environ.get("MOASPEC_VERBOSE")),
            )
        except Exception as e:  # a damaged build: build once more from scratch; no compiler: say so
            if attempt == 0 and any(build.iterdir()):
                log.warning("the int8/int4 kernels in %s did not load (%s); rebuilding them", build, e)
                shutil.rmtree(build, ignore_errors=True)
                build.mkdir(parents=True, exist_ok=True)
                continue
            cxx = os.environ.get("CXX", "c++")  # what torch's cpp_extension compiles with
            if shutil.which(cxx) is None:
                raise UserError(f"could not build the int8/int4 kernels: no C++ compiler ({cxx!r} is not on PATH); "
                                "install g++ and python3-dev (or point $CXX at one), or use --weights fp16") from e
            tail = str(e)[-400:].partition("\n")[2] or str(e)[-400:]  # the last lines, whole
            raise UserError(f"could not build the int8/int4 kernels ({type(e).__name__}: {tail.strip()}); "
                            "install a C++ compiler (g++) and python3-dev, or use --weights fp16") from e
    raise AssertionError("unreachable")


def source_tag() -> str:
    """A short hash of the kernels' source: what cached measurements of them are keyed on."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:8]


def available() -> bool:
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the compiled extension cannot be built or loaded here (the build's own error), or None where it can."""
    try:
        kernels()
    except UserError as e:
        return str(e)
    return None


def kernels_or_none():
    """The compiled extension, or None where it cannot be built (optional speed-ups then fall back)."""
    try:
        return kernels()
    except UserError:
        return None


def f16_override() -> bool | None:
    """`MOASPEC_F16_KERNEL=few|fbgemm`: fp16 layers of 1-8 rows through the few-row kernel or fbgemm,
    whatever the runtime measured (`Transformer.few_row_kernels`); None when unset."""
    forced = os.environ.get("MOASPEC_F16_KERNEL", "")
    if forced not in ("", "few", "fbgemm"):
        raise UserError(f"MOASPEC_F16_KERNEL must be 'few' or 'fbgemm', not {forced!r}")
    return None if not forced else forced == "few"


def machine_key() -> str:
    """What a measurement of the kernels depends on: their source, torch, the CPU and the thread count."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"{source_tag()}|torch {torch.__version__}|{cpu} ({len(cpu_flags())} flags)|{threads} threads"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output channel: (q [out, in] int8, scale [out] float32)."""
    w = w.float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4(w: torch.Tensor, group: int = 32,
                  chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4, a fp16 scale and offset per `group` inputs: (packed [out, in/2] uint8, scale,
    offset [out, in/group] float16). Within each 32-value block byte j holds value j in its low
    nibble and value j + 16 in its high one (the kernel unpacks a block with one shift and one mask).

    Each group's scale and offset minimise the squared error: a few narrowed ranges are tried, each
    with its least-squares refit (min-max rounding alone doubled the logit error on SmolLM2)."""
    out, inp = w.shape
    if group not in INT4_GROUPS or inp % group:
        raise UserError(f"int4 needs a group size in {INT4_GROUPS} dividing the layer's {inp} inputs")
    parts = [_int4_groups(w[i:i + chunk].float().reshape(-1, inp // group, group)) for i in range(0, out, chunk)]
    q, scale, offset = (torch.cat(t) for t in zip(*parts, strict=True))
    blocks = q.reshape(out, inp // BLOCK, 2, BLOCK // 2)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, inp // 2)
    return packed.contiguous(), scale.contiguous(), offset.contiguous()


def _int4_groups(g: torch.Tensor, narrowing: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)):
    """q [.., G] uint8, scale, offset [..] fp16 with the least squared error over the candidates."""
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    best = None
    for f in narrowing:
        mid, half = (hi + lo) / 2, (hi - lo) / 2 * f
        s0 = (2 * half / 15).clamp_min(1e-8)
        q = torch.round((g - (mid - half)) / s0).clamp_(0, 15)
        # least-squares refit of w ~ s * q + m for these q, then fp16 rounding of (s, m)
        n = g.shape[-1]
        sq, sw = q.sum(-1, keepdim=True), g.sum(-1, keepdim=True)
        sqq, sqw = (q * q).sum(-1, keepdim=True), (q * g).sum(-1, keepdim=True)
        den = n * sqq - sq * sq
        s = torch.where(den > 0, (n * sqw - sq * sw) / den.clamp_min(1e-12), s0)
        m = (sw - s * sq) / n
        s, m = s.half().float(), m.half().float()
        err = ((s * q + m - g) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = [q, s, m, err]
        else:
            take = err < best[3]
            best = [torch.where(take, new, old) for new, old in zip((q, s, m, err), best, strict=True)]
    q, s, m, _ = best
    return q.to(torch.uint8), s[..., 0].half(), m[..., 0].half()


def on_int4_grid(w: torch.Tensor, group: int = BLOCK, sample_rows: int = 64) -> bool:
    """Whether int4 with this group holds `w` exactly: true of the tensors a Q4_0/Q4_1 GGUF de-quantised to
    (the least-squares refit recovers each block's scale and offset). A sample of rows answers most no's."""
    if w.shape[1] % group:
        return False
    for rows in (w[:sample_rows], w):
        if not torch.equal(dequantize_int4(*quantize_int4(rows, group)), rows.float()):
            return False
    return True


def channels() -> int:
    """Output channels the integer kernels interleave, one int32 lane each: 16 with AVX-512, else 8. A
    layer whose outputs they do not divide runs in fp16 (`linear.runnable_mode`)."""
    return int(kernels().channels())


def interleave_int8(q: torch.Tensor) -> torch.Tensor:
    """The kernels' layout of int8 weights [out, in]: [out / C, in / 4, C, 4] for C = `channels()`, each
    4-value chunk of C channels side by side (one register; see qgemm.cpp)."""
    out, inp = q.shape
    c = channels()
    return q.reshape(out // c, c, inp // 4, 4).transpose(1, 2).contiguous()


def interleave_int4(packed: torch.Tensor, scale: torch.Tensor,
                    offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' layout of `quantize_int4`'s output: weights [out / C, in / 32, 4, C, 4] uint8 for C =
    `channels()` (chunk k of a block: per channel, values 4k..4k+3 in the low nibbles, 16+4k..16+4k+3 in
    the high ones), scale and offset [out / C, in / group, C]."""
    out, half = packed.shape
    c = channels()
    inp = half * 2
    blocks = packed.reshape(out, inp // BLOCK, BLOCK // 2)
    values = torch.cat([blocks & 15, blocks >> 4], 2)  # [out, blocks, 32] in input order
    v = values.reshape(out // c, c, inp // BLOCK, 2, 4, 4)  # channel group, channel, block, half, k, j
    chunks = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).contiguous()  # group, block, k, channel, j

    def by_group(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(out // c, c, -1).transpose(1, 2).contiguous()

    return chunks, by_group(scale), by_group(offset)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """float32 [rows, in] of packed int4 rows (also what an embedding lookup of a few rows uses)."""
    out, half = packed.shape
    inp = half * 2
    group = inp // scale.shape[1]
    blocks = packed.reshape(out, inp // BLOCK, 1, BLOCK // 2)
    q = torch.cat([blocks & 15, blocks >> 4], 2).reshape(out, inp // group, group).float()
    return (q * scale.float()[..., None] + offset.float()[..., None]).reshape(out, inp)
