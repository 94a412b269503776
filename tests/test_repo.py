"""The repository's promises: README's two commands exist and CI runs exactly the test one."""
import ast
import io
import re
import tokenize
from dataclasses import fields
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick

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
    r"\brank\s*[%]", r"\brank\s*//", r"[%]\s*[\w.]*(tp|dp|pp|sp)_size\b", r"//\s*[\w.]*(tp|dp|pp|sp)_size\b",
    r"\b(tp|dp|pp|sp)_rank\s*[*+]", r"[*+]\s*[\w.]*\b(tp|dp|pp|sp)_rank\b", r"device_count\(\)", r"\btp_rank\s*==\s*0",
    r"environ(\.get)?\(\s*['\"]LOCAL_RANK", r"mesh\.mesh\b", r"get_rank\(\)\s*[%/]",
]
FSDP_INTERNALS = [r"\bfully_shard\b", r"engines\.fsdp import", r"torch\.distributed\.fsdp", r"\.hf\.", r"\.module\b\.(parameters|eval|train)"]


def _py_files(outside: str):
    for path in sorted((ROOT / "spmdrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(outside):
            yield rel, path.read_text()


def test_every_package_directory_is_a_regular_package():
    """setuptools' package discovery skips a directory without __init__.py: an installed spmdrl would lack it."""
    dirs = {p.parent for p in (ROOT / "spmdrl").rglob("*.py")}
    missing = sorted(str(d.relative_to(ROOT)) for d in dirs if not (d / "__init__.py").is_file())
    assert not missing, missing


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


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _spmdrl_modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text()) for p in sorted((ROOT / "spmdrl").rglob("*.py"))}


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """module -> the spmdrl modules it imports, at module level or inside a function alike (a deferred import is
    still a dependency). `from pkg import sub` is an edge to the submodule; the implicit import of a module's
    parent packages is not an edge."""
    graph = {}
    for name, tree in modules.items():
        is_pkg = any(m.startswith(name + ".") for m in modules)
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level else node.module
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                deps.update(subs if len(subs) == len(node.names) else [base, *subs])
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(d + ".")}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_cycle_detection_finds_a_planted_cycle():
    planted = {"spmdrl.a": ast.parse("def f():\n    from spmdrl.b import g"), "spmdrl.b": ast.parse("from spmdrl import a"),
               "spmdrl": ast.parse(""), "spmdrl.c": ast.parse("import spmdrl.a")}
    assert import_cycles(import_graph(planted)) == [["spmdrl.a", "spmdrl.b"]]


def test_no_import_cycles_in_spmdrl():
    cycles = import_cycles(import_graph(_spmdrl_modules()))
    assert not cycles, "import cycles (move the shared code to where it belongs):\n" + "\n".join(map(str, cycles))


# A class is read in one module: its methods are defined there, or reached through a named attribute whose type
# is visible where it is built. A base class from another spmdrl module (a mixin) splits a class across files
# and turns every `self.x` into a search; subclassing within one module (the error hierarchy) and subclassing
# library classes (nn.Module, torch.autograd.Function, Protocol) are fine.
def test_no_class_split_across_modules_by_inheritance():
    modules = _spmdrl_modules()
    defined = {node.name: mod for mod, tree in modules.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    hits = []
    for mod, tree in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name in defined and defined[name] != mod or (name or "").endswith("Mixin"):
                    hits.append(f"{mod}.{node.name} inherits {defined.get(name, '?')}.{name}")
    assert not hits, "classes split across modules by inheritance:\n" + "\n".join(hits)


def test_no_merge_conflict_markers():
    """A merge resolved by hand must not leave its markers in code, docs or configs."""
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    hits = []
    for sub in ("spmdrl", "tests", "docs", "launch", "configs", "slurm"):
        for path in (ROOT / sub).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".md", ".toml", ".sh", ".sbatch", ".yaml", ".json"):
                text = path.read_text(errors="replace")
                hits += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}" for m in marker.finditer(text)]
    readme = (ROOT / "README.md").read_text()
    hits += [f"README.md:{readme[:m.start()].count(chr(10)) + 1}" for m in marker.finditer(readme)]
    assert not hits, hits


# A config override written after a `#` is silently dropped: `"section.key": value` or `section.key=value`.
OVERRIDE_IN_COMMENT = re.compile(r"""["']([a-z_]+)\.[a-z_.]+["']\s*:|\b([a-z_]+)\.[a-z_]+=["'\w\[{]""")


def overrides_in_comments(source: str, sections: set[str]) -> list[tuple[int, str]]:
    """(line, comment) of every comment that holds a config override of one of `sections`."""
    hits = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            if any((m.group(1) or m.group(2)) in sections for m in OVERRIDE_IN_COMMENT.finditer(tok.string)):
                hits.append((tok.start[0], tok.string))
    return hits


def test_override_in_comment_detection_finds_a_planted_one():
    planted = 'o = {\n    "actor.lr": 1e-3,  # fast "trainer.device": "cpu",\n}\nargs = ["a.b=1"]  # trainer.seed=3\n'
    assert [line for line, _ in overrides_in_comments(planted, {"trainer", "actor"})] == [2, 4]
    assert not overrides_in_comments('x = {"actor.lr": 1}  # the actor\'s rate\n', {"trainer", "actor"})


def test_no_test_loses_a_config_override_to_a_comment():
    from spmdrl.config import Config

    sections = {f.name for f in fields(Config)}
    hits = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in sorted((ROOT / "tests").rglob("*.py"))
            for line, text in overrides_in_comments(p.read_text(), sections)]
    assert not hits, "config overrides inside comments (they never reach the config):\n" + "\n".join(hits)


# Names that hold a training engine in spmdrl/loop/, spmdrl/reshard/ and spmdrl/checkpoint/ (the rollout engine
# is `rollout` there); every attribute read on them must be a member of engines/base.py's protocols.
ENGINE_NAMES = {"actor", "ref", "critic", "engine"}


def engine_attributes(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, attribute) of every attribute read on a training engine: `actor.x`, `self.engine.x`,
    `self.engines[role].x`, `getattr(engine, "x", ...)`."""

    def is_engine(node) -> bool:
        if isinstance(node, ast.Name):
            return node.id in ENGINE_NAMES
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr in ENGINE_NAMES
        return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "engines")

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_engine(node.value):
            out.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and is_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            out.append((node.lineno, node.args[1].value))
    return out


def protocol_members() -> set[str]:
    from spmdrl.engines.base import AdapterEngine

    members = set()
    for cls in AdapterEngine.__mro__:
        if cls.__module__ == "spmdrl.engines.base":
            members |= {k for k in vars(cls) if not k.startswith("_")} | set(getattr(cls, "__annotations__", {}))
    return members


def test_engine_attribute_detection_finds_a_planted_call():
    planted = ast.parse("def f(self, engine):\n    engine.logprobs(1)\n    self.actor.hf.x\n"
                        "    self.engines['actor'].offload()\n    getattr(engine, 'device', None)\n")
    assert sorted(engine_attributes(planted)) == [(2, "logprobs"), (3, "hf"), (4, "offload"), (5, "device")]
    assert {"logprobs", "offload", "device", "adapters_disabled", "adapter_tensors"} <= protocol_members()
    assert "hf" not in protocol_members()


def test_loop_reshard_checkpoint_call_engine_protocol_members_only():
    members = protocol_members()
    hits = []
    for pkg in ("spmdrl/loop", "spmdrl/reshard", "spmdrl/checkpoint"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, attr in engine_attributes(ast.parse(path.read_text())):
                if attr not in members:
                    hits.append(f"{path.relative_to(ROOT)}:{line}: .{attr}")
    assert not hits, ("engine members called outside the protocol (declare them in spmdrl/engines/base.py's "
                      "TrainEngine or AdapterEngine):\n" + "\n".join(hits))


# The calls of the training role that docs/architecture.md's "One step" lists, line for line (colocated path):
# Trainer.take_batch, then Trainer.training_role, then step's metric reduction.
STEP_OBJECTS = {"memory", "generator", "scorer", "rounds", "learner"}
STEP_FUNCTIONS = {"SampleRounds", "redistribute", "weight_sync", "reduce_step_metrics"}


def step_calls(fn: ast.FunctionDef) -> list[str]:
    """The tracked calls of a step function in source order (a hook as its quoted name)."""
    calls = []

    def visit(node):
        if isinstance(node, ast.Call):
            f = node.func
            base = f.value.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) else (
                f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None)
            if isinstance(f, ast.Name) and f.id == "hooks" and isinstance(node.args[0], ast.Constant):
                calls.append((node.lineno, node.col_offset, f'"{node.args[0].value}"'))
            elif isinstance(f, ast.Name) and f.id in STEP_FUNCTIONS:
                calls.append((node.lineno, node.col_offset, f.id))
            elif isinstance(f, ast.Attribute) and (base in STEP_OBJECTS or f.attr in STEP_FUNCTIONS):
                calls.append((node.lineno, node.col_offset, f.attr if f.attr in STEP_FUNCTIONS else f"{base}.{f.attr}"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in fn.body:
        visit(stmt)
    return [name for _, _, name in sorted(calls)]


def doc_step_calls(text: str) -> list[str]:
    block = re.search(r"The training role, line for line.*?```\n(.*?)```", text, flags=re.S).group(1)
    out = []
    for line in block.splitlines():
        code = re.split(r"\s{2,}", line.strip())[0]  # the annotation follows two or more spaces
        out += re.findall(r'"\w+"', code) if code.startswith('"') else re.findall(r"[A-Za-z_][\w.]*(?=\()", code)
    return out


def test_architecture_one_step_matches_trainer_step_line_for_line():
    tree = ast.parse((ROOT / "spmdrl" / "loop" / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    method = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    code = step_calls(method["take_batch"]) + step_calls(method["training_role"]) + step_calls(method["step"])
    assert len(code) > 20 and '"after_rollout"' in code and "learner.update_actor" in code
    assert doc_step_calls((ROOT / "docs" / "architecture.md").read_text()) == code


# What has run on a GPU is stated in one place, docs/architecture.md's table; code and scripts carry no such notes.
GPU_NOTES = [
    r"\b(never|not)\s+(been\s+)?(run|ran|measured)\b[^.;]{0,30}\b(GPU|H100|H200|CUDA)\b",
    r"\b(ran|run|measured)\s+on\s+(one|a|an|two|\d+)\s+(x\s+)?(H100|H200|GPUs?)\b",
    r"\bnever\s+run\s+here\b", r"CUDA only[;,]\s*never\s+run\b", r"\bno GPU was available\b",
]
# This project's issue numbers (a cited external tracker, `owner/repo issue N`, is a source, not history).
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|\(#\d+\)", re.I)
EXTERNAL_ISSUE = re.compile(r"[\w.-]+/[\w.-]+(?:'s)?\s+issue")


def gpu_notes(text: str) -> list[str]:
    flat = re.sub(r"\s*\n\s*(#\s*)?", " ", text)  # a sentence may run over lines and comment markers
    return [m.group(0) for p in GPU_NOTES for m in re.finditer(p, flat, flags=re.I)]


def issue_numbers(text: str) -> list[str]:
    return [m.group(0) for line in text.splitlines() if not EXTERNAL_ISSUE.search(line)
            for m in ISSUE_NUMBER.finditer(line)]


def test_note_and_issue_detection_find_planted_ones():
    assert gpu_notes("x = 1  # the CUDA calls have never run on a\n# GPU here")
    assert gpu_notes('"""Ran on one H100 (single rank)."""') and gpu_notes("# CUDA only; never run")
    assert not gpu_notes("the GPU path never calls it; a tool call that is never run")
    assert issue_numbers("the layout test (iss" + "ue 13)") and issue_numbers("fixed in (" + "#12)")
    assert not issue_numbers("measured in NVIDIA/nccl issue 1685") and not issue_numbers("NVIDIA/nccl's issue tracker (#1685)")


def test_no_gpu_status_notes_in_code():
    files = sorted((ROOT / "spmdrl").rglob("*.py")) + sorted((ROOT / "launch").glob("*"))
    hits = [f"{p.relative_to(ROOT)}: {n}" for p in files if p.is_file() for n in gpu_notes(p.read_text())]
    assert not hits, "GPU status belongs in docs/architecture.md's table only:\n" + "\n".join(hits)


def test_no_issue_numbers_in_code_tests_or_docs():
    files = [p for d in ("spmdrl", "tests", "docs", "launch", "configs") for p in sorted((ROOT / d).rglob("*"))
             if p.is_file() and p.suffix in (".py", ".md", ".sh", ".toml")] + [ROOT / "README.md"]
    hits = [f"{p.relative_to(ROOT)}: {n}" for p in files for n in issue_numbers(p.read_text())]
    assert not hits, "issue numbers are history, not documentation:\n" + "\n".join(hits)


# What the config means is derived once, in spmdrl/config/derived.py; the loop, the engines and `spmdrl plan` call it.
CONFIG_MEANINGS = [
    r"rollout\.engine\s*==", r"\bdtype\s*==\s*\"auto\"", r"\bvllm_available\(", r"use_kl_loss\s+or\b",
    r"\b(actor|critic|ref)_offload\b", r"\.top_p\s*<\s*1", r"\.rollout_is\s*!=", r"\.lora_sync\s*==",
    r"ppo_mini_batch_size\s+or\b", r"forward_micro_batch_size\s+or\b", r"\.ref\.micro_batch_size\b",
]
# decisions decoded in spmdrl/config/derived.py alone, everywhere else (validation included) by calling it
DECODED_ONCE = [r"router_replay\s*(==|!=|\bin\b)", r"router_replay\s*\)?\s*(==|!=)"]


def decoded_outside_derived(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted((root / "spmdrl").rglob("*.py"))
            if p.name != "derived.py" for i, line in enumerate(p.read_text().splitlines(), 1)
            if not line.lstrip().startswith("#") and any(re.search(c, line) for c in DECODED_ONCE)]


def test_router_replay_detection_finds_a_planted_decoding(tmp_path):
    (tmp_path / "spmdrl" / "loop").mkdir(parents=True)
    (tmp_path / "spmdrl" / "loop" / "x.py").write_text('replay = cfg.actor.router_replay == "rollout"\n')
    assert decoded_outside_derived(tmp_path) == ['spmdrl/loop/x.py:1: replay = cfg.actor.router_replay == "rollout"']


def test_router_replay_is_decoded_in_derived_only():
    hits = decoded_outside_derived(ROOT)
    assert not hits, "call spmdrl.config.derived.replays_routes instead:\n" + "\n".join(hits)


def test_loop_engines_and_plan_do_not_rederive_config_meanings():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for d in ("loop", "engines", "plan") for p in sorted((ROOT / "spmdrl" / d).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1)
            if not line.lstrip().startswith("#") and any(re.search(c, line) for c in CONFIG_MEANINGS)]
    assert not hits, "derive these in spmdrl/config/derived.py and call it:\n" + "\n".join(hits)


def test_gpu_tier_runs_every_file_with_gpu_tests():
    """launch/gpu_tier.sh names the files it collects (collecting the whole suite would import vLLM on a GPU
    machine without it): every test file parametrised over devices.DEVICES or marked gpu must be among them."""
    script = (ROOT / "launch" / "gpu_tier.sh").read_text()
    listed = re.search(r'^TIER_FILES="([^"]*)"', script, flags=re.M).group(1).split()
    covered = lambda rel: any(rel == f or rel.startswith(f.rstrip("/") + "/") for f in listed)
    uses = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("test_*.py"))
            if p.name != "test_repo.py" and re.search(r"\bDEVICES\b|\bgpu_only\b|mark\.gpu\b", p.read_text())]
    assert uses and "tests/gpu/test_gpu_fsdp.py" in uses
    assert [u for u in uses if not covered(u)] == [], listed


def test_gpu_tier_time_limit_covers_its_tests_own_limits():
    """The tier's limit (TIER_TIMEOUT's default in launch/gpu_tier.sh) holds the subprocess limits of its tests
    together (each test's timeout=), plus a minute for the tests that start nothing: a test's own limit, with its
    message and output, fires before the tier cuts the run."""
    script = (ROOT / "launch" / "gpu_tier.sh").read_text()
    tier = int(re.search(r"TIER_TIMEOUT:-(\d+)", script).group(1))
    listed = re.search(r'^TIER_FILES="([^"]*)"', script, flags=re.M).group(1).split()
    files = [p for f in listed for p in ([ROOT / f] if f.endswith(".py") else sorted((ROOT / f).rglob("test_*.py")))]
    limits = [int(t) for p in files for t in re.findall(r"\btimeout=(\d+)", p.read_text())]
    assert len(limits) >= 2 and sum(limits) + 60 <= tier, (limits, tier)


def _raise_texts(source: str) -> list[str]:
    """The literal text of every raise statement's message ({} for each formatted value)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            out.append(" ".join(n.value if isinstance(n, ast.Constant) else " {} " for n in ast.walk(node.exc)
                                if isinstance(n, ast.FormattedValue) or (isinstance(n, ast.Constant)
                                                                          and isinstance(n.value, str))))
    return out


def duplicated_refusals(root: Path, n: int = 8) -> list[str]:
    """Runs of n words a refusal in spmdrl/config/ shares with one raised in the packages below the config:
    the same refusal written twice instead of one owner (a function both call)."""
    def grams(text: str) -> set[str]:
        w = re.findall(r"[\w.'=/-]+", text.lower())
        return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1) if "{}" not in w[i:i + n]}

    sides: tuple[dict, dict] = ({}, {})
    for p in sorted((root / "spmdrl").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        side = 0 if rel.startswith("spmdrl/config/") else 1
        for text in _raise_texts(p.read_text()):
            for g in grams(text):
                sides[side].setdefault(g, rel)
    return [f"{sides[0][g]} and {sides[1][g]}: {g}" for g in sorted(set(sides[0]) & set(sides[1]))]


def test_duplicated_refusal_detection_finds_a_planted_one(tmp_path):
    for d, f in (("config", "validate.py"), ("engines", "x.py")):
        (tmp_path / "spmdrl" / d).mkdir(parents=True)
        (tmp_path / "spmdrl" / d / f).write_text(
            'raise ConfigError(f"a = {a}: set model.checkpoint_policy = \'selective\' or model.gradient_checkpointing '
            '= false")\n')
    assert duplicated_refusals(tmp_path)


def test_every_refusal_has_one_owner():
    """A refusal both config validation and an engine raise is one function both call (config/derived.py,
    or the engine's module), not two copies of its text."""
    hits = duplicated_refusals(ROOT)
    assert not hits, "one function for each refusal, called by both sides:\n" + "\n".join(hits)


# config keys that only `spmdrl plan` reads (it also runs before a CUDA launch: the fit check of `spmdrl train`)
PLAN_ONLY_KEYS = {"memory.host_memory_gb", "memory.margin"}
NOT_RUNTIME = ("spmdrl/config/schema.py", "spmdrl/config/validate.py", "spmdrl/config/verl.py", "spmdrl/plan/")


def config_sections() -> dict[str, list[str]]:
    """{section: its keys} of the RL config."""
    import dataclasses

    from spmdrl.config.schema import Config

    out = {}
    for f in dataclasses.fields(Config):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out[f.name] = [g.name for g in dataclasses.fields(default)]
    return out


def _key_reads(source: str, sections: set[str]) -> tuple[set, set, list]:
    """(section, key) pairs read as `<x>.section.key` or through a local bound to `<x>.section`; key names read on
    anything else (a section passed as an argument, getattr with a constant); getattr f-string patterns."""
    tree = ast.parse(source)
    pairs, names, patterns = set(), set(), []
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    for scope in [*scopes, tree]:
        bound = {}
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    both = list(zip(t.elts, n.value.elts)) if isinstance(t, ast.Tuple) and isinstance(
                        n.value, ast.Tuple) else [(t, n.value)]
                    for name, v in both:
                        if isinstance(name, ast.Name) and isinstance(v, ast.Attribute) and v.attr in sections:
                            bound[name.id] = v.attr
        for n in ast.walk(scope):
            if isinstance(n, ast.Attribute):
                b = n.value
                if isinstance(b, ast.Attribute) and b.attr in sections:
                    pairs.add((b.attr, n.attr))
                elif isinstance(b, ast.Name) and b.id in bound:
                    pairs.add((bound[b.id], n.attr))
                else:
                    names.add(n.attr)
            elif isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) >= 2:
                key = n.args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    names.add(key.value)
                elif isinstance(key, ast.JoinedStr):
                    patterns.append("".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+"
                                            for v in key.values))
    return pairs, names, patterns


def keys_read_by_nothing(sections: dict[str, list[str]]) -> list[str]:
    """Config keys no runtime module reads (validation, the verl mapping, the schema and the planner aside)."""
    pairs, names, patterns = set(), set(), []
    for p in sorted((ROOT / "spmdrl").rglob("*.py")):
        if not p.relative_to(ROOT).as_posix().startswith(NOT_RUNTIME):
            a, b, c = _key_reads(p.read_text(), set(sections))
            pairs, names, patterns = pairs | a, names | b, patterns + c
    return [f"{s}.{k}" for s, keys in sections.items() for k in keys
            if (s, k) not in pairs and k not in names and not any(re.fullmatch(pt, k) for pt in patterns)
            and f"{s}.{k}" not in PLAN_ONLY_KEYS]


def test_dead_config_key_detection_finds_a_planted_one():
    sections = config_sections()
    sections["ref"] = [*sections["ref"], "planted_forward_chunk"]
    assert keys_read_by_nothing(sections) == ["ref.planted_forward_chunk"]


def test_every_config_key_is_read_at_runtime():
    """A key only validation, the plan or the verl mapping read does nothing: wire it into the runtime or remove
    it (with a one-line error naming the key to use instead)."""
    dead = keys_read_by_nothing(config_sections())
    assert not dead, f"config keys read by nothing at runtime: {dead}"


def package_lines() -> dict[str, int]:
    """{package or top-level module of spmdrl/: its line} from docs/architecture.md's "Package order" table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## Package order", 1)[1].split("\n## ", 1)[0]
    out = {}
    for row in re.findall(r"^\| (\d+) \| (.*?) \|", table, flags=re.M):
        for name in re.findall(r"`(\w+)`", row[1]):
            out[name] = int(row[0])
    return out


def package_imports(root: Path) -> list[tuple[str, str, str]]:
    """(importing file, its package, the imported package) for every import between two packages (or top-level
    modules) of root/spmdrl, lazy imports included."""
    out = []
    for path in sorted((root / "spmdrl").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if len(parts) < 2 or parts[1] in ("__init__", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                bits = name.split(".")
                if bits[0] == "spmdrl" and len(bits) > 1 and bits[1] != parts[1] and (
                        (root / "spmdrl" / bits[1]).is_dir() or (root / "spmdrl" / f"{bits[1]}.py").is_file()):
                    out.append((path.relative_to(root).as_posix(), parts[1], bits[1]))
    return out


def back_arrows(root: Path, lines: dict[str, int]) -> list[str]:
    return [f"{f}: {src} (line {lines.get(src)}) imports {dst} (line {lines.get(dst)})"
            for f, src, dst in package_imports(root) if src not in lines or dst not in lines or lines[dst] >= lines[src]]


def test_back_arrow_detection_finds_a_planted_one(tmp_path):
    for pkg, text in (("algos", "from spmdrl.loop.trainer import Trainer\n"), ("loop", "from spmdrl.algos import x\n")):
        (tmp_path / "spmdrl" / pkg).mkdir(parents=True)
        (tmp_path / "spmdrl" / pkg / "m.py").write_text(text)
    assert back_arrows(tmp_path, package_lines()) == ["spmdrl/algos/m.py: algos (line 3) imports loop (line 9)"]


def test_packages_import_only_lower_lines_of_the_package_order():
    hits = back_arrows(ROOT, package_lines())
    assert not hits, "imports against docs/architecture.md's package order:\n" + "\n".join(hits)


def quick_modules(root: Path) -> dict[str, set[str]]:
    """{test file with quick tests: the spmdrl packages (and top-level modules) it imports}."""
    out = {}
    for path in sorted((root / "tests").glob("test_*.py")):
        text = path.read_text()
        if "pytest.mark.quick" in text:
            names = set(re.findall(r"\bspmdrl\.(\w+)", text))
            for line in re.findall(r"^\s*from spmdrl import (.+)$", text, flags=re.M):
                names |= {n.split(" as ")[0].strip(" ()") for n in line.split(",")} - {""}
            out[path.name] = names
    return out


def test_the_quick_tier_touches_every_package():
    """`pytest -m quick` (README) imports every package of spmdrl/ in at least one of its test files."""
    packages = sorted(p.name for p in (ROOT / "spmdrl").iterdir() if (p / "__init__.py").is_file())
    touched = set().union(*quick_modules(ROOT).values())
    missing = [p for p in packages if p not in touched]
    assert not missing, f"no quick test imports spmdrl.{missing}: mark one of its tests @pytest.mark.quick"
