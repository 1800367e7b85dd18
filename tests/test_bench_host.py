"""``rlpad bench host`` (rlpad/bench/host.py) and its CPU proxies of a GPU's host side (rlpad/bench/host_proxy.py).

The dry run of the command (a short batch, the tiny model) with the figures that do not depend on the
machine checked: per decoder layer the shared path dispatches the packed row's ops plus its two K/V
gathers, no index is built in a layer, the plan reaches the device in one copy, the workers' call reads
no device value and a direct checked call reads ONE (the checks' host copy, reused for the plan). The
read counter itself against reads it must see and its negative control (a read of an activation raises),
the host copy exact for every dtype a batch holds, and the shared-prompt plan's host ops independent of
the rows (the index lists are run lists, one tensor op set each).
"""

import json

import pytest
import torch

from rlpad.bench.host import _plan
from rlpad.bench.host_proxy import DeviceReads, UntrackedRead
from rlpad.cli import main
from rlpad.core.host_plan import host_copies
from rlpad.embedded.synthetic import grpo_batch


def test_dry_run_figures(tmp_path):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--dry-run", "--models", "tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (shape,) = result["shapes"]
    rmpad, shared = shape["paths"]["rmpad"], shape["paths"]["shared"]
    names = {*shared["layer_ops"], *rmpad["layer_ops"]}
    extra = {k: shared["layer_ops"].get(k, 0) - rmpad["layer_ops"].get(k, 0) for k in names}
    assert {k: v for k, v in extra.items() if v} == {"aten.index_select": 2}, extra  # K and V gathered
    assert rmpad["layer_ops"]["torch_attn._varlen_attn"] == 1  # the sm90 branch ran: one varlen call a layer
    for r in (rmpad, shared):
        assert r["index_ops_per_layer"] == 0 and r["h2d_per_forward"] == 1, r
        assert r["worker"] == 0 and r["checked_call"] == 1, r
        assert [w.split(":")[0] for w in r["checked_call_where"]] == ["rlpad/core/host_plan.py"]  # host_copies
        assert r["copies"]["layer"]["aten._to_copy"][0] == 4  # bf16 RMSNorm's casts, two norms a layer
        assert r["layer_us"] == r["layer_us"] and r["plan_us"] > 0  # measured (no timing asserted)


def test_reads_counted_where_made_and_activations_refused():
    ids = torch.tensor([[3, 1, 4], [1, 5, 9]])
    with DeviceReads() as reads:
        on_device = ids.to("meta")
        assert on_device[0, 1].item() == 1  # answered from the host copy's twin
        assert (on_device > 2).sum(1).tolist() == [2, 2]
        assert on_device[on_device > 4].shape == (2,)  # boolean mask: a nonzero inside
        assert on_device.cumsum(1).shape == (2, 3)  # no read
    assert reads.reads == {"aten._local_scalar_dense": 1, "aten._to_copy": 1, "aten.index": 1}, reads.reads
    assert sum(reads.where.values()) == 3
    weight = torch.empty(3, 3, device="meta")  # an activation: no host data behind it
    with DeviceReads(), pytest.raises(UntrackedRead, match="aten._local_scalar_dense reads a device value"):
        weight.sum().item()


def test_host_copy_is_one_read_and_exact_for_every_dtype():
    big = 2**52 + 1  # an integer id fp64 still holds exactly
    tensors = [torch.tensor([[0, big], [7, 1]]), torch.tensor([[True, False]]), torch.tensor([0.5, -1e-30]),
               torch.tensor([1.0, 3.0], dtype=torch.bfloat16), None]
    with DeviceReads() as reads:
        back = host_copies(*(t if t is None else t.to("meta") for t in tensors))
    assert reads.total() == 1
    for got, want in zip(back, tensors):
        assert (got is None and want is None) or (got.dtype == want.dtype and torch.equal(got, want))
    assert host_copies(*tensors) == tensors  # on the host already: the same tensors, no copy


def test_shared_plan_host_ops_do_not_grow_with_the_rows():
    def batch(groups):
        b = grpo_batch(groups, 8, 32, 16, vocab_size=64, seed=1, min_prompt=4)
        return {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}

    small, large = (_plan(batch(g), 16, "shared", reps=1)["plan_ops"] for g in (2, 6))
    assert small == large, (small, large)  # 16 rows or 48: the same ops (332 -> 73 at 16 rows, before the run lists)


def test_sync_count_reads_the_sync_warning_only():
    """torch.cuda.set_sync_debug_mode warns a prototype notice ONCE per process, with "synchronizing" in
    it: counted as a sync (the GPU lane's test did, by substring) it made the first measured forward
    read 2. The counter takes c10's own warning only, at the line that made it."""
    import warnings

    from rlpad.bench.host_cuda import SYNC_WARNING, count_warnings

    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"

    def forward():
        warnings.warn(notice)
        warnings.warn(SYNC_WARNING)  # the one sync

    n, where = count_warnings(forward, SYNC_WARNING)
    assert n == 1 and list(where) == [f"tests/test_bench_host.py:{forward.__code__.co_firstlineno + 2}"], where
    assert count_warnings(forward, "synchroniz")[0] == 2  # control: the old substring count


def test_head_rounding_truncation_biases_and_promotion_removes_it():
    """rlpad/bench/head_rounding.py's emulation at hidden 3584: the tensor cores' truncating accumulation
    biases the logits toward zero (the top logits are positive: their mean error is negative, many times the
    rounding-to-nearest one) and the log-probs follow; moving the partial sum out every 256 products (the
    fused head's tiles) brings both within a few times fp32's own rounding."""
    from rlpad.bench.head_rounding import accumulation_errors

    e = accumulation_errors(8, vocab=8192, top=256, tokens=64)
    tc, promoted, nearest = e["tensor_core"], e["tensor_core_p256"], e["rn_sequential"]
    assert tc["dz_mean"] < 0 and abs(tc["dz_mean"]) > 10 * abs(nearest["dz_mean"]), e
    assert tc["lp_max"] > 5 * promoted["lp_max"] and tc["dz_max"] > 5 * promoted["dz_max"], e
    assert promoted["lp_max"] < 2 * max(nearest["lp_max"], 1e-6), e


@pytest.mark.parametrize("path", ["rmpad", "shared"])
def test_graphed_measurement_equals_the_plain_forward_on_its_cpu_fallback(path):
    """rlpad bench host --device cuda's `graphed` variant (the backbone of one micro-batch replayed from a
    CUDA graph) runs eagerly on the CPU: the same numbers as the forward, bit for bit, its index plan rebuilt
    and copied into the recorded inputs each call. Control: with those inputs zeroed, the copy restores
    them (zeroed ids give other numbers)."""
    from rlpad.bench.host import micro_batch
    from rlpad.bench.host_cuda import _graphed, _plain
    from rlpad.core.host_plan import HostBatch
    from rlpad.embedded.tiny import tiny_model

    model = tiny_model("qwen2", vocab_size=256, seed=1).eval()
    b = micro_batch(12, 6)
    host = HostBatch.of(*b.values())
    with torch.no_grad():
        ref = _plain(model, b, 6, path, host)()
        fn = _graphed(model, b, 6, path, host)
        got = fn()
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        ids = fn.inputs["input_ids"]
        kept = ids.clone()
        ids.zero_()
        zeroed = model.model(**fn.inputs).last_hidden_state
        ids.copy_(kept)
        assert not torch.equal(zeroed, model.model(**fn.inputs).last_hidden_state)  # the ids matter
        ids.zero_()
        again = fn()  # copies the plan's ids back before the backbone runs
        assert torch.equal(again[0], ref[0]) and torch.equal(fn.inputs["input_ids"], kept)
