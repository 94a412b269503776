"""The repository's promises: README's two commands exist and CI runs exactly the test one."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_install_and_test_commands():
    main, test = readme_commands()
    assert "launch/install_cpu.sh" in main and "launch/quickstart.sh" in main
    assert "launch/install_cpu.sh" in test and "pytest" in test
    for script in ("launch/install_cpu.sh", "launch/quickstart.sh"):
        assert (ROOT / script).is_file(), script


def test_ci_runs_readme_test_command():
    _, test = readme_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert test in ci.splitlines(), "'.ci/run' must run README.md's test command verbatim"


def test_top_level_layout():
    for name in ("spmdrl", "launch", "configs", "slurm", "tests", "docs", "setup.cfg", "pyproject.toml", "README.md"):
        assert (ROOT / name).exists(), name


# Rank arithmetic belongs in spmdrl/dist/ (RoleMesh, layout); elsewhere code asks its mesh.
RANK_ARITHMETIC = [
    r"\brank\s*[%]", r"\brank\s*//", r"[%]\s*[\w.]*(tp|dp|pp)_size\b", r"//\s*[\w.]*(tp|dp|pp)_size\b",
    r"\b(tp|dp|pp)_rank\s*[*+]", r"[*+]\s*[\w.]*\b(tp|dp|pp)_rank\b", r"device_count\(\)", r"\btp_rank\s*==\s*0",
    r"environ(\.get)?\(\s*['\"]LOCAL_RANK", r"mesh\.mesh\b", r"get_rank\(\)\s*[%/]",
]
FSDP_INTERNALS = [r"\bfully_shard\b", r"engines\.fsdp import", r"torch\.distributed\.fsdp", r"\.hf\.", r"\.module\b\.(parameters|eval|train)"]


def _py_files(outside: str):
    for path in sorted((ROOT / "spmdrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(outside):
            yield rel, path.read_text()


def test_no_rank_arithmetic_outside_dist():
    hits = [f"{rel}:{i}: {line.strip()}" for rel, text in _py_files("spmdrl/dist/")
            for i, line in enumerate(text.splitlines(), 1)
            if not line.lstrip().startswith("#") and any(re.search(p, line) for p in RANK_ARITHMETIC)]
    assert not hits, "rank arithmetic outside spmdrl/dist/ (ask the RoleMesh):\n" + "\n".join(hits)


def test_trainer_code_uses_only_the_engine_protocol():
    """Nothing outside spmdrl/engines/ builds FSDP or reaches into an engine's internals."""
    allowed = ("spmdrl/engines/", "spmdrl/faults.py")  # faults: test-only NaN injection
    hits = [f"{rel}:{i}: {line.strip()}" for rel, text in _py_files("spmdrl/engines/") if not rel.startswith(allowed)
            for i, line in enumerate(text.splitlines(), 1) if any(re.search(p, line) for p in FSDP_INTERNALS)]
    assert not hits, "\n".join(hits)


def test_no_module_over_500_lines():
    long = [f"{rel}: {len(text.splitlines())}" for rel, text in _py_files("-") if len(text.splitlines()) > 500]
    assert not long, long
