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
