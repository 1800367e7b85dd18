"""The GPU lane's parts that run without a GPU: `make test-gpu` refuses in one line, and its wheels
+ install step give an importable rlpad on a python that has only what the GPU machine has.

The GPU machine is simulated by this interpreter run with ``-S`` (no site-packages) and a folder
of links to its site-packages MINUS what that machine lacks (omegaconf, Ray, vLLM, flash-attn) and
minus rlpad's own editable install; the lane's scripts run from a fresh copy of the repository's
files (``git ls-files``: what a clone has, without .whl/, .venv or caches). The wheels are
downloaded by scripts/gpu_wheels.sh once (needs PyPI, as `make setup` does) into .cache/gpu_wheels
and reused by later runs; the install step never touches the network (``--no-index``).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_CACHE = os.path.join(ROOT, ".cache", "gpu_wheels")
# What the GPU image lacks (or must not be seen): import names / distribution names, and .pth hooks.
ABSENT = re.compile(r"^(omegaconf|ray|vllm|flash_attn|antlr4|rlpad)([-_.]|$)|^__editable__|\.pth$", re.IGNORECASE)
NO_CUDA = not torch.cuda.is_available()
MAKE_OWN_LINE = re.compile(r"^make(\[\d+\])?: ")  # make's own lines; "make[1]:" when run under make test


def run(cmd, cwd=ROOT, env=None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **kw)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_make_test_gpu_without_cuda_exits_with_one_line():
    direct = run(["bash", "scripts/test_gpu.sh"], env={**os.environ, "PY": sys.executable})
    assert direct.returncode == 1
    assert direct.stdout == "" and direct.stderr.count("\n") == 1, direct.stderr
    assert direct.stderr.startswith("make test-gpu: no CUDA device (torch ") and "sees none" in direct.stderr
    made = run(["make", "-s", "test-gpu", f"PY={sys.executable}"])
    ours = [line for line in (made.stdout + made.stderr).splitlines() if not MAKE_OWN_LINE.match(line)]
    assert made.returncode != 0 and ours == direct.stderr.splitlines()
    without_torch = run(["bash", "scripts/test_gpu.sh"], env={**os.environ, "PY": f"{sys.executable} -S"})
    assert without_torch.returncode == 1 and without_torch.stderr.count("\n") == 1
    assert "no CUDA device (" in without_torch.stderr and "has no torch" in without_torch.stderr


def fresh_copy(dest: str) -> str:
    """The repository's files as a clone has them (tracked + untracked-not-ignored), into ``dest``."""
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]).stdout.split("\0")
    for rel in filter(None, listed):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    return dest


def carried_wheels(clone: str) -> list[str]:
    """The wheels scripts/gpu_wheels.sh names, downloaded into the cache once (run from the clone)."""
    specs = re.search(r"^WHEELS=\((.*)\)$", open(os.path.join(clone, "scripts", "gpu_wheels.sh")).read(), re.M)
    names = [s.replace("==", "-") for s in specs.group(1).split()]
    have = lambda: [f for f in os.listdir(WHEEL_CACHE) if f.endswith(".whl")] if os.path.isdir(WHEEL_CACHE) else []  # noqa: E731
    if not all(any(f.startswith(n + "-") for f in have()) for n in names):
        got = run(["bash", "scripts/gpu_wheels.sh", WHEEL_CACHE], cwd=clone, env={**os.environ, "PY": sys.executable})
        assert got.returncode == 0, f"scripts/gpu_wheels.sh failed (it needs PyPI):\n{got.stderr[-2000:]}"
    return [os.path.join(WHEEL_CACHE, f) for f in have() if any(f.startswith(n + "-") for n in names)]


def gpu_like_site(dest: str) -> str:
    """Links to this interpreter's site-packages entries, minus what the GPU machine lacks."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    os.makedirs(dest)
    for name in os.listdir(site):
        if not ABSENT.search(name):
            os.symlink(os.path.join(site, name), os.path.join(dest, name))
    return dest


def test_wheels_and_install_step_from_a_fresh_copy(tmp_path):
    clone = fresh_copy(str(tmp_path / "clone"))
    assert not os.path.exists(os.path.join(clone, ".whl"))
    site = gpu_like_site(str(tmp_path / "gpu_site"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=site, PY=f"{sys.executable} -S", PIP_NO_INDEX="1")  # the GPU machine: no network
    isolated = [sys.executable, "-S", "-c"]

    # Negative control: that python has torch and transformers but cannot import rlpad's config (omegaconf).
    probe = "import torch, transformers, rlpad.recipe.load"
    bare = run([*isolated, probe], cwd=clone, env={**env, "PYTHONPATH": f"{clone}:{site}"})
    assert bare.returncode != 0 and "No module named 'omegaconf'" in bare.stderr, bare.stderr[-500:]

    no_wheels = run(["bash", "scripts/gpu_site.sh", str(tmp_path / "t0")], cwd=clone, env=env)
    assert no_wheels.returncode == 1 and "no wheels in" in no_wheels.stderr and "gpu_wheels.sh" in no_wheels.stderr

    os.makedirs(os.path.join(clone, ".whl"))
    for wheel in carried_wheels(clone):
        shutil.copy2(wheel, os.path.join(clone, ".whl"))
    target = str(tmp_path / "rlpad-gpu-site")
    done = run(["bash", "scripts/gpu_site.sh", target], cwd=clone, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # rlpad from the copy, omegaconf from the carried wheel, and no Ray / vLLM pulled in (checked there).
    rlpad_file, omegaconf_file = os.path.join(clone, "rlpad", "__init__.py"), os.path.join(target, "omegaconf", "__init__.py")
    assert f"gpu_site: rlpad from {rlpad_file}, omegaconf from {omegaconf_file}" in done.stdout, done.stdout

    # The lane's own test modules import on that python too (pytest adds itself and, for the
    # conftest.py files of tests/gpu and tests, those two folders to sys.path).
    lane = "import sys; sys.path[:0] = ['tests/gpu', 'tests']; import test_cuda_exactness, test_cuda_workers, test_cuda_train"
    imported = run([*isolated, lane], cwd=clone, env={**env, "PYTHONPATH": f"{clone}:{target}:{site}"})
    assert imported.returncode == 0, imported.stderr[-1500:]


def test_report_folds_tests_figures_and_benchmarks(tmp_path):
    """scripts/gpu_report.py on outputs shaped like the lane's (no GPU needed to build a report)."""
    out = tmp_path / "gpu"
    (out / "parts").mkdir(parents=True)
    (out / "steps.tsv").write_text("install\t0\t3\ntests\t1\t200\nbench_logprob\t0\t40\nbench_prefix\t124\t100\n")
    (out / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_cuda_exactness" name="test_a[qwen2]" time="1.5"/>'
        '<testcase classname="tests.gpu.test_cuda_train" name="test_b" time="0.1"><skipped message="needs vLLM and Ray '
        '(not installed)"/></testcase>'
        '<testcase classname="tests.gpu.test_cuda_workers" name="test_c" time="2"><failure message="assert 0.3 &lt;= 2e-05">'
        "long traceback</failure></testcase></testsuite></testsuites>")  # fmt: skip
    errs = {"lp_max": 1e-3, "lp_mean": 2e-4, "ent_max": 1e-4, "ent_mean": 1e-5, "grad_rel": 0.01, "grad_cos_min": 0.9999}
    (out / "parts" / "test_a_qwen2.json").write_text(json.dumps({
        "test": "x", "arch": "qwen2", "kernel": "torch_varlen", "errors": {"rmpad/rollout": errs, "leak/rollout": errs},
        "bounds": errs, "calls": {"rmpad": {"forward_calls": 2, "backward_calls": 2, "cuda_fwd_launches": 2, "cuda_bwd_launches": 6,
                             "flash_kernels": ["flash_fwd_kernel"]}}}))
    (out / "parts" / "test_c.json").write_text(json.dumps({"test": "y", "peak_gpu_memory_mib": 812.5, "gain": 0.2}))
    (out / "bench_logprob.json").write_text(json.dumps({"speed": {"forward": {"tokens_per_s": 1.5e6, "mfu": 0.41}},
                                                         "device": "NVIDIA H100 80GB HBM3"}))
    (out / "bench_prefix.log").write_text("line 1\nerror: something broke\n")
    done = run([sys.executable, "scripts/gpu_report.py", str(out), "--wall-s", "350"])
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["summary"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert [s["timed_out"] for s in report["steps"]] == [False, False, False, True]
    assert report["bench"]["logprob"]["json"]["speed"]["forward"]["mfu"] == 0.41 and report["bench"]["prefix"]["json"] is None
    md = (out / "report.md").read_text()
    for expected in ("| skipped | tests.gpu.test_cuda_train::test_b | 0.1 | needs vLLM and Ray (not installed) |",
                     "| failed | tests.gpu.test_cuda_workers::test_c | 2.0 | assert 0.3 <= 2e-05 |",
                     "| qwen2 | rmpad/rollout | 0.001 | 0.0002 |", "peak_gpu_memory_mib=812.5",
                     "op calls 2 / 2, FlashAttention launches 2 / 6: flash_fwd_kernel",
                     "| speed.forward.mfu | 0.41 |", "| bench_prefix | 124 (timed out) | 100 |", "error: something broke",
                     "torch " + torch.__version__):  # fmt: skip
        assert expected in md, expected


def test_report_shows_the_logprob_benchmark_as_its_tables(tmp_path):
    """A real `rlpad bench logprob --device cuda` result (its code on CPU, tiny shape, two columns, no
    profile) comes out of the report as the benchmark's own Markdown tables, not key by key."""
    from rlpad.bench.logprob_cuda import cuda_tables, measure_shape
    from rlpad.bench.table import format_markdown

    shape = measure_shape(torch.device("cpu"), "tiny", rows=4, prompt=8, response=12, micro_rows=2, chunk=16, reps=1,
                          columns=("rmpad", "padded"), profile=False)
    result = {"date": "2026-11-25", "shapes": [shape], "memory": []}
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "junit.xml").write_text('<testsuites><testsuite name="pytest"><testcase classname="t" name="a" time="1"/>'
                                   "</testsuite></testsuites>")
    (out / "steps.tsv").write_text("bench_logprob\t0\t150\n")
    (out / "bench_logprob.json").write_text(json.dumps(result))
    done = run([sys.executable, "scripts/gpu_report.py", str(out)], env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    md = (out / "report.md").read_text()
    assert format_markdown(cuda_tables(result)) in md
    assert "| shapes[0]" not in md  # not the key/value fallback


def test_gpu_run_dry_run_on_the_cpu(tmp_path):
    """`make gpu-run`'s script end to end on the CPU (RLPAD_GPU_DRY_RUN=1): the lane (skipped without
    CUDA), the head's tile sweep under Triton's interpreter, bench head | logprob | prefix with
    --dry-run, and one report holding every step, every benchmark's own table and the targets table;
    then the targets read real figures out of those JSONs once their shapes carry the GPU run's names
    (the tiny shapes stand in), so a renamed key fails here, not on the GPU."""
    from rlpad.bench.gpu_targets import TARGETS, target_rows

    out = tmp_path / "run"
    env = {**os.environ, "RLPAD_GPU_DRY_RUN": "1", "PY": sys.executable, "PYTHONPATH": ROOT}
    done = run(["bash", "scripts/test_gpu.sh", str(out)], env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [(s[0], s[1]) for s in steps] == [(n, "0") for n in ("tests", "bench_head_sweep", "bench_head",
                                                                 "bench_logprob", "bench_prefix", "bench_host",
                                                                 "bench_logprob_vl", "bench_compiled")]
    md = (out / "report.md").read_text()
    assert "**DRY RUN on the CPU**" in md and "## Targets (issues #34 and #54)" in md
    for t in TARGETS:
        assert f"| {t.name} |" in md, t.name
    for bench in ("head --sweep", "head", "logprob", "prefix", "host", "logprob --vl", "logprob --columns compiled"):
        assert f"### rlpad bench {bench} --device cuda: exit 0" in md, bench
    assert "### rlpad bench logprob --columns flex --device cuda: exit not run" in md  # apart since issue #54
    assert "| packed_compiled" in md and "packed_compiled: decoder layers under torch.compile" in md
    assert "VL log-prob + entropy, tiny-vl-dry on cpu" in md and "| shared" in md  # the VL step's own table
    assert "LM head tile sweep" in md and "HBM model per grid order" in md and "| packed_sdpa" in md.replace(" ", " ")
    report = json.loads((out / "report.json").read_text())
    sweep = report["bench"]["head_sweep"]["json"]
    assert all(r["ok"] for r in sweep["rows"]), sweep["rows"]  # every order exact under the interpreter
    assert report["summary"]["failed"] == 0 and report["summary"]["skipped"] > 0

    # The targets' extractors on these real JSONs, relabelled with the GPU run's shapes.
    bench = {k: v["json"] for k, v in report["bench"].items()}
    small, large = sorted({r["tokens"] for r in bench["head"]["rows"]})
    relabel = {small: 4800, large: 19000}
    for key in ("head", "head_sweep"):
        for r in bench[key]["rows"]:
            r["tokens"] = relabel[r["tokens"]]
    bench["head_sweep"]["best"] = {str(relabel[int(k)]): v for k, v in bench["head_sweep"]["best"].items()}
    for r in bench["head"]["rows"]:
        r["peak_gib"] = 1.0  # CUDA only
    tiny = bench["logprob"]["shapes"][0]
    assert "packed_flex" not in tiny["fwd"] and bench["flex"] is None  # apart since issue #54
    for mode in ("fwd", "fwdbwd"):
        tiny[mode]["rmpad"]["mfu"] = 0.5  # on a GPU of the peak table only (path_rates' rmpad_mfu)
    bench["logprob"]["shapes"] = [{**tiny, "model": m} for m in ("qwen2.5-0.5b", "7b-layers")]
    shape = bench["prefix"]["shapes"][0]
    bench["prefix"]["shapes"] = [{**shape, "prompt": p, "model": m} for p, m in
                                 ((512, "qwen2.5-0.5b"), (128, "qwen2.5-0.5b"), (512, "7b-layers"))]
    micro = bench["host"]["shapes"][0]
    assert set(micro["runs"]) == {f"{p}/{v}" for p in ("rmpad", "shared") for v in ("plain", "rms_norm", "graphed")}
    assert micro["runs"]["rmpad/graphed"]["lp_max_diff_vs_plain"] == 0  # its eager fallback: the forward's numbers
    bench["host"]["shapes"] = [{**micro, "prompt": p} for p in (512, 128)]
    figures = {"test_no_host_sync_per_layer_bf16": {"synchronizing_calls": {
        "rmpad/2 layers/forward": 1, "rmpad/2 layers/forward, host copy given": 0,
        "rmpad/2 layers/forward+backward": [1, 1]}}}
    rows = target_rows({"bench": {k: {"json": v} for k, v in bench.items()}, "figures": figures, "wall_s": 100,
                        "summary": report["summary"], "tests": report["tests"]})
    missing = [r["name"] for r in rows if r["value"] is None]
    assert missing == ["7b-layers fwd+bwd: rmpad speed-up over packed flex_attention",  # apart
                       "7b-layers fwd+bwd: rmpad speed-up over packed + liger",  # liger: CUDA only
                       "qwen2.5-0.5b fwd+bwd: rmpad speed-up over packed flex_attention"], missing
    assert tiny["skipped"]["packed_liger"] == "liger-kernel's kernels need CUDA"
    assert all(isinstance(r["met"], bool) for r in rows if r["value"] is not None)
