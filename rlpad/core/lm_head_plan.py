"""The fused LM head's launch plan (:mod:`rlpad.core.lm_head_triton`): tile configurations per GPU
capability and token count, the forward's grid order, the backward's vocabulary slice, and the
HBM-traffic model that chose the order. Plain Python (no Triton): the bench, the docs and the CPU
tests read it on any machine.

Grid orders of the forward (``n_blocks`` token blocks x ``splits`` vocabulary splits, one program
each, numbered by ``pid``; :func:`program_coords`):

* ``token_fastest``: consecutive programs take consecutive token blocks at one split. The programs
  resident at once each hold their own hidden panel (``BLOCK_N x H``); at 19000 tokens x H 3584 that
  is ~120 MB, past a 50 MB L2, so every vocabulary tile re-reads every panel from HBM (~160 GB);
* ``vocab_fastest`` (the default): consecutive programs take consecutive splits of one token block.
  With ``splits >= resident / group`` (``group``: the panels half the L2 holds) any window of
  ``resident`` consecutive programs holds at most ``group + 1`` panels, which stay in L2, and each
  weight tile is read once per window for all of them;
* ``grouped``: as ``_dz_kernel``: ``group`` token blocks x every split, token fastest inside the group.
  A window that straddles two groups holds up to twice the panels, so it re-reads them unless
  ``group x splits`` is a multiple of the resident programs.

:func:`forward_traffic` models the HBM bytes of each order (``rlpad bench head`` prints it beside the
choice); docs/performance.md has its figures at the 7B head's shape.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

__all__ = ["DZ_BUDGET_BYTES", "GPUS", "GRID_ORDERS", "INTERPRETER_GPU", "PROMOTE", "TILE_TABLE", "Gpu", "Tiles", "choose_tiles",
           "device_gpu", "dz_columns", "forward_traffic", "head_plan", "plan_splits", "program_coords", "resident_programs"]

log = logging.getLogger(__name__)

GRID_ORDERS = ("token_fastest", "vocab_fastest", "grouped")
WAVES = 4  # programs per SM the forward aims for at least (vocabulary splits x token blocks)
# The backward writes dz for a vocabulary slice at a time: at most this many bytes (N x columns x
# element size), whatever logits_chunk_size says, while N x BLOCK_V alone fits (N <= 4.19M tokens in
# bf16 at BLOCK_V 128). 1 GiB: 6 slices at N = 19000, V = 152064 (a whole-vocabulary slice: 5.8 GB).
DZ_BUDGET_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One launch configuration: tile (tokens, vocabulary, hidden), warps, pipeline stages, the
    forward's grid order and its group (token blocks per group; None: sized to half the L2), and
    ``promote``: every that many hidden elements (a multiple of ``block_k``; 0: never) the logits'
    partial sums leave the tensor core's accumulator for an fp32 add that rounds to nearest
    (:data:`PROMOTE`: why)."""

    block_n: int
    block_v: int
    block_k: int
    warps: int
    stages: int
    order: str = "vocab_fastest"
    group: int | None = None
    promote: int = 0

    def __post_init__(self):
        if self.order not in GRID_ORDERS:
            raise ValueError(f"grid order must be one of {GRID_ORDERS}, got {self.order!r}")
        if min(self.block_n, self.block_v, self.block_k, self.warps, self.stages, self.group or 1) < 1 or self.group == 0:
            raise ValueError(f"tile sizes, warps, stages and group must be >= 1, got {self}")
        if self.promote < 0 or self.promote % self.block_k:
            raise ValueError(f"promote must be 0 or a positive multiple of block_k={self.block_k}, got {self.promote}")

    @property
    def name(self) -> str:
        group = "" if self.order != "grouped" else f"/{self.group or 'L2'}"
        promote = f" p{self.promote}" if self.promote else ""
        return f"{self.block_n}x{self.block_v}x{self.block_k} w{self.warps} s{self.stages}{promote} {self.order}{group}"

    def smem_bytes(self, elem: int = 2) -> int:
        """Shared memory of the pipelined operand tiles (h: BLOCK_N x BLOCK_K, W: BLOCK_K x BLOCK_V)."""
        return self.stages * (self.block_n + self.block_v) * self.block_k * elem


@dataclasses.dataclass(frozen=True)
class Gpu:
    """What the traffic model needs of a GPU (the bench reads a real one from torch)."""

    name: str
    sms: int
    l2_bytes: int
    smem_per_sm: int
    hbm_bytes_per_s: float


INTERPRETER_GPU = Gpu("Triton interpreter", 4, 1 << 20, 1 << 20, 1e11)  # CPU tensors: only the plan's arithmetic
GPUS = {"H100": Gpu("H100 SXM", 132, 50 << 20, 228 << 10, 3.35e12), "H200": Gpu("H200", 132, 50 << 20, 228 << 10, 4.8e12),
        "A100": Gpu("A100 SXM", 108, 40 << 20, 164 << 10, 2.0e12)}


@functools.cache
def device_gpu(device) -> tuple[Gpu, tuple[int, int], int | None]:
    """``(Gpu, capability, shared memory per block)`` of a torch ``device``, read once (the CPU: the
    interpreter's). HBM bandwidth is not in torch's properties: by name from :data:`GPUS`, else H100's."""
    if device.type != "cuda":
        return INTERPRETER_GPU, (0, 0), None
    import torch

    p = torch.cuda.get_device_properties(device)
    bandwidth = next((g.hbm_bytes_per_s for k, g in GPUS.items() if k in p.name), GPUS["H100"].hbm_bytes_per_s)
    gpu = Gpu(p.name, p.multi_processor_count, getattr(p, "L2_cache_size", 40 << 20),
              getattr(p, "shared_memory_per_multiprocessor", 164 << 10), bandwidth)
    return gpu, (p.major, p.minor), getattr(p, "shared_memory_per_block_optin", None)


# The tensor cores accumulate a dot's products in fp32 with truncation (round toward zero) at each step of
# 16 products: over the 7B head's hidden 3584 (224 steps) the logits come out biased toward zero, ~2.4e-5 on
# average, up to 6e-5: log-prob errors to 2.6e-5 on 32 of the lane's rows (4-5e-5 on its 384: the H200's
# 5.16e-5 against the bound 5e-5), where fp32 on CUDA cores (round to nearest, torch's fp32 GEMM) reaches
# 5e-6. Moving the partial sum out every 256 products (one fp32 add, to nearest) brings the head to 1.6e-6
# (every 128: 1.0e-6, 512: 3.8e-6, 1024: 5.9e-6). Measured by emulating both accumulators on the CPU in
# fp64 (docs/performance.md, "The head's rounding"). The price: a second fp32 accumulator tile in registers.
PROMOTE = 256
# Capability -> ((max tokens of the bucket or None for the rest, tiles), ...), first match wins. Every entry
# promotes (PROMOTE), on tiles whose two fp32 accumulators fit the registers (<= 64 floats a thread each:
# 128x128 on 8 warps, 64x128 on 4): not yet timed on a GPU (the sweep times them beside the unpromoted ones).
# 9.0 before issue #54: <= 2048 tokens 64x128x64 w4 s4; above, the sweep's winner of 2026-11-27 (H200, 16 of
# 27 configurations): 256x128x32 w8 s4, 37.4 ms fwd+bwd at 4800 tokens and 147.6 at 19000 (128x128x64 w8 s3:
# 41.8 and 153.7), whose 128 accumulator floats a thread cannot double. 8.0: not yet measured.
TILE_TABLE: dict[tuple[int, int], tuple[tuple[int | None, Tiles], ...]] = {
    (9, 0): ((2048, Tiles(64, 128, 64, 4, 4, promote=PROMOTE)), (None, Tiles(128, 128, 64, 8, 3, promote=PROMOTE))),
    (8, 0): ((2048, Tiles(64, 128, 32, 4, 4, promote=PROMOTE)), (8192, Tiles(128, 128, 32, 8, 4, promote=PROMOTE)),
             (None, Tiles(128, 128, 64, 8, 3, promote=PROMOTE))),
}


def choose_tiles(capability: tuple[int, int], tokens: int, smem_optin: int | None = None) -> Tiles:
    """The table's tiles for ``tokens`` on a GPU of ``capability`` (the nearest lower one in the table;
    8.0's below it), stages cut to what ``smem_optin`` (bytes per block) holds. Logged once per choice."""
    known = sorted(TILE_TABLE)
    cap = max((c for c in known if c <= tuple(capability)), default=known[0])
    tiles = next(t for limit, t in TILE_TABLE[cap] if limit is None or tokens <= limit)
    if smem_optin:
        per_stage = tiles.smem_bytes() // tiles.stages
        tiles = dataclasses.replace(tiles, stages=max(1, min(tiles.stages, smem_optin // per_stage)))
    bucket = next(limit for limit, t in TILE_TABLE[cap] if limit is None or tokens <= limit)
    _log_choice(tuple(capability), cap, bucket, tiles)
    return tiles


@functools.cache
def _log_choice(capability, table_key, bucket, tiles) -> None:
    log.info("rlpad LM head: sm_%d%d (table %d.%d), tokens %s: %s", *capability, *table_key,
             f"<= {bucket}" if bucket else "above the last bucket", tiles.name)


def l2_group(tiles: Tiles, hidden: int, l2_bytes: int, elem: int = 2) -> int:
    """Token blocks per group: as many hidden panels (BLOCK_N x H) as half the L2 holds."""
    return tiles.group or max(1, (l2_bytes // 2) // (tiles.block_n * hidden * elem))


def resident_programs(tiles: Tiles, gpu: Gpu, elem: int = 2) -> int:
    """Programs resident at once: SMs x what shared memory, registers (an estimate: the fp32
    accumulator twice over, plus 32) and the 64-warp limit allow per SM."""
    regs = min(255, 32 + 2 * tiles.block_n * tiles.block_v // (32 * tiles.warps))
    per_sm = min(gpu.smem_per_sm // tiles.smem_bytes(elem), 65536 // (regs * 32 * tiles.warps), 64 // tiles.warps)
    return gpu.sms * max(1, per_sm)


def plan_splits(n_blocks: int, v_tiles: int, sms: int, resident: int, group: int, order: str) -> int:
    """Vocabulary splits: token blocks x splits at least WAVES programs per SM (a few thousand tokens
    still fill the GPU) and, for the orders that share panels, enough splits that one wave of
    ``resident`` programs spans at most ``group`` token blocks."""
    splits = -(-WAVES * sms // max(1, n_blocks))
    if order != "token_fastest":
        splits = max(splits, -(-resident // min(group, n_blocks)))
    return max(1, min(v_tiles, splits))


def program_coords(pid: int, n_blocks: int, splits: int, order: str, group: int) -> tuple[int, int]:
    """``(token block, split)`` of program ``pid``: the Python twin of ``_program`` in the kernel."""
    if order == "token_fastest":
        return pid % n_blocks, pid // n_blocks
    if order == "vocab_fastest":
        return pid // splits, pid % splits
    per_group = group * splits
    first = (pid // per_group) * group
    size = min(n_blocks - first, group)
    return first + (pid % per_group) % size, (pid % per_group) // size


def forward_traffic(tokens: int, hidden: int, vocab: int, tiles: Tiles, gpu: Gpu, *, splits: int | None = None,
                    elem: int = 2) -> dict[str, float]:
    """HBM bytes of one forward launch, by waves of resident programs run in step: per tile step a
    wave reads each distinct weight tile once (shared by its token blocks) and its distinct hidden
    panels once if they fit in half the L2, else once per step. Returns the inputs' and the total."""
    n_blocks, v_tiles = -(-tokens // tiles.block_n), -(-vocab // tiles.block_v)
    resident, group = resident_programs(tiles, gpu, elem), l2_group(tiles, hidden, gpu.l2_bytes, elem)
    splits = splits or plan_splits(n_blocks, v_tiles, gpu.sms, resident, group, tiles.order)
    per_split = -(-v_tiles // splits)
    splits = -(-v_tiles // per_split)
    panel, w_tile = tiles.block_n * hidden * elem, tiles.block_v * hidden * elem
    programs = n_blocks * splits
    h_bytes = w_bytes = 0.0
    for start in range(0, programs, resident):
        coords = [program_coords(p, n_blocks, splits, tiles.order, group) for p in range(start, min(programs, start + resident))]
        blocks, parts = {c[0] for c in coords}, {c[1] for c in coords}
        steps = max(min(per_split, v_tiles - s * per_split) for s in parts)
        w_bytes += steps * len(parts) * w_tile
        fits = len(blocks) * panel <= gpu.l2_bytes // 2
        h_bytes += len(blocks) * panel * (1 if fits else steps)
    total = h_bytes + w_bytes
    return {"order": tiles.order, "splits": splits, "group": group if tiles.order == "grouped" else None,
            "resident": resident, "waves": math.ceil(programs / resident), "hidden_gb": h_bytes / 1e9,
            "weight_gb": w_bytes / 1e9, "total_gb": total / 1e9, "ms_at_hbm": total / gpu.hbm_bytes_per_s * 1e3}


def dz_columns(tokens: int, vocab: int, block_v: int, chunk_size: int | None, elem: int,
               budget: int = DZ_BUDGET_BYTES) -> int:
    """Vocabulary columns of one backward slice: whole ``block_v`` tiles (at least one) such that
    ``tokens x columns`` holds at most ``chunk_size x vocab`` elements and ``budget`` bytes."""
    cols = budget // max(1, tokens * elem)
    if chunk_size is not None:
        cols = min(cols, chunk_size * vocab // max(1, tokens))
    return min(vocab, max(block_v, cols // block_v * block_v))


def head_plan(tokens: int, hidden: int, vocab: int, device) -> dict:
    """What the fused head would launch for ``tokens`` on ``device`` (a CPU: an H100, capability 9.0)
    and the HBM model of each grid order with those tiles: the bench prints it beside the choice."""
    if device.type == "cuda":
        gpu, capability, smem = device_gpu(device)
    else:
        gpu, capability, smem = GPUS["H100"], (9, 0), 227 << 10
    tiles = choose_tiles(capability, tokens, smem)
    orders = [forward_traffic(tokens, hidden, vocab, dataclasses.replace(tiles, order=o), gpu) for o in GRID_ORDERS]
    return {"tokens": tokens, "gpu": gpu.name, "capability": f"{capability[0]}.{capability[1]}", "tiles": tiles.name,
            "order": tiles.order, "orders": orders}
