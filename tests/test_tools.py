"""Tools: the runner (failures, timeouts, concurrency, async), the registry, the calculator, the Python sandbox's
limits, and http_exec against a local HTTP server. No model or engine: everything here runs in seconds."""
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from spmdrl.config import load_config, validate
from spmdrl.config.schema import MultiTurnConfig
from spmdrl.errors import ConfigError
from spmdrl.tools.base import FAILURES, Tool, ToolCall
from spmdrl.tools.builtin import calculator_tool, http_exec_tool, python_tool
from spmdrl.tools.calculator import calculate
from spmdrl.tools.registry import load_tools
from spmdrl.tools.runner import ThreadToolRunner, build_tool_runner
from spmdrl.tools.sandbox import SandboxLimits, interpreter_problem, run_python


def one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert str(n) in msg, (n, msg)
    return msg


def tool(fn, name=None) -> Tool:
    return Tool(name or fn.__name__, "", {"type": "object", "properties": {}}, fn)


# ---------------------------------------------------------------------------------------------- the runner

def add(a: int, b: int) -> str:
    return str(a + b)


def boom(**_) -> str:
    raise ValueError("bad\nthing")


def hang(seconds: float = 3) -> str:
    time.sleep(seconds)
    return "woke"


@pytest.mark.quick
def test_every_failure_kind_gives_one_error_result_and_the_other_calls_run():
    runner = ThreadToolRunner(
        [tool(add), tool(boom), tool(hang), tool(lambda: object(), "obj"), tool(lambda: None, "none"),
         tool(lambda: float("nan"), "nan"), tool(lambda: "\ud800", "surrogate"), tool(lambda: {"k": [1, 2]}, "dict")],
        timeout_s=0.5, max_parallel=16, max_calls_per_turn=3)
    ok = ToolCall("add", {"a": 2, "b": 3})
    calls = [
        [ToolCall("boom"), ok],
        [ToolCall("hang"), ok],
        [ToolCall("add", error="the tool call is not valid JSON"), ToolCall("nosuch", {"x": 1}), ok],
        [ok, ok, ok, ToolCall("add", {"a": 1, "b": 1})],  # the 4th is over max_calls_per_turn = 3
        [ToolCall("obj"), ToolCall("none"), ToolCall("nan")],
        [ToolCall("surrogate"), ToolCall("dict"), ToolCall("add", {"a": 1})],  # a missing argument: TypeError
    ]
    t0 = time.monotonic()
    res = runner.run(calls)
    assert time.monotonic() - t0 < 5  # the hanging call does not hold the turn past its timeout
    kinds = [[r.failure for r in turn] for turn in res]
    assert kinds == [["exception", ""], ["timeout", ""], ["malformed", "unknown_tool", ""],
                     ["", "", "", "too_many_calls"], ["bad_output"] * 3,
                     ["bad_output", "", "exception"]]
    assert all(r.text == "5" for turn in res for r in turn if r.ok and r.name == "add")
    assert res[0][0].text == "error: ValueError: bad thing"  # one line
    assert "0.5s" in res[1][0].text and res[1][0].seconds == 0.5
    assert res[2][0].text == "the tool call is not valid JSON"
    assert "'nosuch'" in res[2][1].text and "add" in res[2][1].text
    assert "more than 3 tool calls" in res[3][3].text
    assert res[5][1].text == '{"k": [1, 2]}' and "TypeError" in res[5][2].text
    assert all("\n" not in r.text for turn in res for r in turn)
    assert set(FAILURES) == {k for turn in kinds for k in turn if k}

    m = runner.take_metrics()
    assert m["tools/calls"] == sum(map(len, calls)) == 17
    assert m["tools/failures"] == 10
    assert m["tools/failures/boom/exception"] == 1 and m["tools/failures/hang/timeout"] == 1
    assert m["tools/failures/_unknown/unknown_tool"] == 1 and m["tools/failures/add/malformed"] == 1
    assert m["tools/failures/add/too_many_calls"] == 1 and m["tools/failures/add/exception"] == 1
    assert m["tools/calls/add"] == 9 and m["tools/seconds/hang"] == 0.5 and m["tools/seconds"] > 0.5
    assert runner.take_metrics() == {}  # taken
    assert runner.run([[ok]])[0][0].text == "5"  # the runner goes on after an abandoned call


def test_calls_run_concurrently_and_timeouts_overlap():
    runner = ThreadToolRunner([tool(hang)], timeout_s=1.5, max_parallel=8)
    t0 = time.monotonic()
    res = runner.run([[ToolCall("hang", {"seconds": 0.5})] * 2 for _ in range(4)])
    assert [r.text for turn in res for r in turn] == ["woke"] * 8
    assert time.monotonic() - t0 < 2.5  # 8 x 0.5 s one after the other would be 4 s

    runner = ThreadToolRunner([tool(hang)], timeout_s=0.4, max_parallel=8)
    t0 = time.monotonic()
    res = runner.run([[ToolCall("hang")] for _ in range(8)])
    assert [r[0].failure for r in res] == ["timeout"] * 8
    assert time.monotonic() - t0 < 2.4  # about one timeout, not eight (3.2 s)

    runner = ThreadToolRunner([tool(hang)], timeout_s=5, max_parallel=2)
    t0 = time.monotonic()
    runner.run([[ToolCall("hang", {"seconds": 0.3})] for _ in range(4)])
    assert time.monotonic() - t0 >= 0.6  # two at a time: two rounds


def test_async_tools_share_a_loop_concurrently_and_are_cancelled_on_timeout():
    cancelled = threading.Event()

    async def nap(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    async def forever() -> str:
        try:
            await asyncio.sleep(60)
        finally:
            cancelled.set()
        return "never"

    async def fails() -> str:
        raise KeyError("k")

    async def exits() -> str:
        sys.exit(3)

    async def blocks() -> str:
        time.sleep(1.5)  # sync code in an async tool: blocks its loop
        return "late"

    runner = ThreadToolRunner([tool(nap), tool(forever), tool(fails), tool(exits), tool(blocks)], timeout_s=0.5, max_parallel=16)
    t0 = time.monotonic()
    res = runner.run([[ToolCall("nap", {"seconds": 0.3})] for _ in range(10)] + [[ToolCall("forever")],
                                                                                 [ToolCall("fails")]])
    assert time.monotonic() - t0 < 1.5
    assert [r[0].text for r in res[:10]] == ["slept 0.3"] * 10
    assert res[10][0].failure == "timeout" and cancelled.wait(2)
    assert res[11][0].failure == "exception" and "KeyError" in res[11][0].text
    assert runner.run([[ToolCall("nap", {"nope": 1})]])[0][0].failure == "exception"  # bad arguments
    assert "SystemExit" in runner.run([[ToolCall("exits")]])[0][0].text
    assert runner.run([[ToolCall("nap", {"seconds": 0.01})]])[0][0].ok  # the loop survived

    assert runner.run([[ToolCall("blocks")]])[0][0].failure == "timeout"
    t0 = time.monotonic()
    assert runner.run([[ToolCall("nap", {"seconds": 0.01})]])[0][0].text == "slept 0.01"  # on a fresh loop
    assert time.monotonic() - t0 < 1.0
    runner.close()


@pytest.mark.quick
def test_per_trajectory_kwargs_from_the_data_row():
    seen = []

    def check(answer: str, ground_truth: str = "", scale: int = 1) -> str:
        seen.append((answer, ground_truth, scale))
        return "right" if answer == ground_truth else "wrong"

    def anything(**kw) -> str:
        return json.dumps(kw, sort_keys=True)

    runner = ThreadToolRunner([tool(check), tool(anything)], timeout_s=5)
    verl_style = {"check": {"create_kwargs": {"ground_truth": "42", "unused": 1}, "execute_kwargs": {"scale": 3}},
                  "anything": {"x": 1}}
    res = runner.run([[ToolCall("check", {"answer": "42", "ground_truth": "model's own"}), ToolCall("anything")],
                      [ToolCall("check", {"answer": "42"})]],
                     kwargs=[verl_style, None])
    assert [r.text for r in res[0]] == ["right", '{"x": 1}'] and res[1][0].text == "wrong"
    assert seen[0] == ("42", "42", 3)  # the row's keywords win over the model's; unknown ones are dropped


# ---------------------------------------------------------------------------------------------- the registry

@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(textwrap.dedent('''
        from spmdrl.tools.base import Tool

        def multiply(a: int, b: int) -> str:
            """Multiply two integers.

            Args:
                a: The first factor.
                b: The second factor.
            """
            return str(a * b)

        async def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: The key.
            """
            return key.upper()

        def untyped(a):
            """No types.

            Args:
                a: something
            """
            return a

        def make_echo():
            return Tool("echo", "Echo the text.", {"type": "object", "properties": {"text": {"type": "string"}}},
                        lambda text: text)

        def not_a_factory():
            return 3

        def factory_raises():
            raise RuntimeError("no\\nconfig")

        ECHO = make_echo()
        NUMBER = 7
    '''))
    return str(path)


@pytest.mark.quick
def test_load_tools_from_files_modules_and_builtins(tools_file):
    tools = load_tools([f"{tools_file}:multiply", f"{tools_file}:lookup", f"{tools_file}:make_echo", "calculator"])
    assert [t.name for t in tools] == ["multiply", "lookup", "echo", "calculator"]
    assert tools[0].schema() == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "The first factor."},
            "b": {"type": "integer", "description": "The second factor."}}}}}
    assert tools[1].is_async and not tools[0].is_async
    res = ThreadToolRunner(tools, timeout_s=5).run([[ToolCall("multiply", {"a": 6, "b": 7}),
                                                     ToolCall("lookup", {"key": "k"}), ToolCall("echo", {"text": "hi"}),
                                                     ToolCall("calculator", {"expression": "2**70"})]])
    assert [r.text for r in res[0]] == ["42", "K", "hi", str(2**70)]
    assert load_tools([f"{tools_file}:ECHO"])[0].name == "echo"
    assert load_tools(["spmdrl.tools.builtin:calculator_tool"])[0].name == "calculator"


@pytest.mark.parametrize("spec_fmt,needles", [
    ("{dir}/missing.py:f", ["missing.py", "not found", "multi_turn.tools"]),
    ("{file}:nope", ["'nope'", "callables there", "multiply"]),
    ("{file}:NUMBER", ["is a int"]),
    ("{file}:untyped", ["type hint", "Args"]),
    ("{file}:not_a_factory", ["returned int, not a Tool", "-> str"]),
    ("{file}:factory_raises", ["RuntimeError", "no config"]),
    ("calculater", ["not a built-in tool", "calculator"]),
    ("no_such_pkg_xyz.mod:fn", ["'no_such_pkg_xyz.mod'", "not found"]),
    ("", ["not a tool"]),
])
def test_registry_errors_are_one_line_naming_the_spec(tools_file, tmp_path, spec_fmt, needles):
    spec = spec_fmt.format(dir=tmp_path, file=tools_file)
    with pytest.raises(ConfigError) as e:
        load_tools([spec])
    one_line(e, repr(spec), *needles)


def test_registry_refuses_duplicate_names_and_http_exec_without_url(tools_file):
    with pytest.raises(ConfigError) as e:
        load_tools([f"{tools_file}:ECHO", f"{tools_file}:make_echo"])
    one_line(e, "'echo'", "distinct", f"{tools_file}:ECHO")
    with pytest.raises(ConfigError) as e:
        load_tools(["http_exec"], MultiTurnConfig())
    one_line(e, "multi_turn.http_exec_url")


def test_validate_loads_the_tools_before_anything_is_built(tools_file, tmp_path):
    def cfg(*overrides):
        return load_config(None, ["model.path=/models/tiny", 'data.train_files=["train.parquet"]', *overrides])

    validate(cfg("multi_turn.enable=true", f'multi_turn.tools=["calculator", "{tools_file}:multiply"]'), 1)
    with pytest.raises(ConfigError) as e:
        validate(cfg("multi_turn.enable=true", f'multi_turn.tools=["{tmp_path}/gone.py:f"]'), 1)
    one_line(e, "gone.py", "not found")
    with pytest.raises(ConfigError) as e:
        validate(cfg('multi_turn.tools=["http_exec"]', "multi_turn.http_exec_url=http://x",
                     "multi_turn.http_exec_timeout_s=20"), 1)
    one_line(e, "multi_turn.http_exec_timeout_s = 20", "tool_timeout_s = 10")
    with pytest.raises(ConfigError) as e:
        validate(cfg("multi_turn.sandbox_memory_mb=8"), 1)
    one_line(e, "multi_turn.sandbox_memory_mb")


# ---------------------------------------------------------------------------------------------- the calculator

@pytest.mark.quick
def test_calculator_matches_python_integer_arithmetic():
    rng = random.Random(0)
    for _ in range(300):  # sums and differences of products of long integers, as Python's ints compute them
        expected, parts = 0, []
        for k in range(rng.randint(1, 5)):
            factors = [rng.randint(-10**rng.randint(1, 60), 10**rng.randint(1, 60)) for _ in range(rng.randint(1, 3))]
            product = 1
            for f in factors:
                product *= f
            sign = rng.choice("+-") if k else ""
            expected += -product if sign == "-" else product
            parts.append(f"{sign} " + " * ".join(f"({f})" for f in factors))
        expr = " ".join(parts)
        assert calculate(expr) == str(expected), expr
    assert calculate("3**2000 * 7**1000 - 1") == str(3**2000 * 7**1000 - 1)
    assert calculate("123456789012345678901234567890 // 7") == str(123456789012345678901234567890 // 7)
    assert calculate("-(17 % 5) + 2^10") == str(-(17 % 5) + 2**10)


@pytest.mark.parametrize("expr,value", [
    ("7 / 2", "3.5"), ("10 / 5", "2"), ("0.1 + 0.2", "0.3"), ("1.5e3 * 2", "3000"), ("2 ** -2", "0.25"),
    ("1 / 3", "0." + "3" * 50), ("(1.25)", "1.25"),
])
@pytest.mark.quick
def test_calculator_decimals(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr,needle", [
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("__import__('os')", "not arithmetic"),
    ("x + 1", "not arithmetic"), ("'a' * 3", "not a number"), ("9 ** 9 ** 9", "more than 4000 digits"),
    ("2 +", "cannot parse"), ("", "give an arithmetic expression"), ("(-8) ** 0.5", "undefined"),
    ("1 < 2", "not arithmetic"), ("(" * 200 + "1" + ")" * 200, ""),
])
@pytest.mark.quick
def test_calculator_errors_say_what_is_wrong(expr, needle):
    res = ThreadToolRunner([calculator_tool()], timeout_s=5).run([[ToolCall("calculator", {"expression": expr})]])
    r = res[0][0]
    if needle == "":  # deep nesting: either a value or a clear error, never a crash
        assert r.ok or r.failure == "exception"
        return
    assert r.failure == "exception" and needle in r.text and "\n" not in r.text, r.text


# ---------------------------------------------------------------------------------------------- the sandbox

def _sandbox_python() -> str:
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if candidate and not interpreter_problem(candidate):
            return candidate
    pytest.skip("no Python interpreter the sandbox user can run")


@pytest.fixture(scope="module")
def sandbox_python():
    return _sandbox_python()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie runs nothing
    except FileNotFoundError:
        return True


def test_sandbox_caps_forks_and_leaves_nothing_running(sandbox_python):
    code = textwrap.dedent("""
        import os, time
        pids = []
        for i in range(200):
            try:
                pid = os.fork()
            except OSError as e:
                print("fork refused:", type(e).__name__)
                break
            if pid == 0:
                time.sleep(60)
                os._exit(0)
            pids.append(pid)
        print(len(pids), " ".join(map(str, pids)))
    """)
    r = run_python(code, SandboxLimits(processes=8, wall_s=20), python=sandbox_python)
    refused, counts = r.stdout.splitlines()
    assert refused == "fork refused: BlockingIOError", r
    n, *pids = counts.split()
    assert 0 < int(n) <= 8 and len(pids) == int(n)
    time.sleep(0.2)
    assert all(_gone(int(p)) for p in pids), "a forked child survived the run"


def test_sandbox_caps_a_real_fork_bomb(sandbox_python):
    code = textwrap.dedent("""
        import os, time
        print(os.getpid(), flush=True)
        for _ in range(40):  # every process forks again: 2**40 without the limit
            try:
                os.fork()
            except OSError:
                pass
        time.sleep(60)
    """)
    t0 = time.monotonic()
    r = run_python(code, SandboxLimits(processes=8, wall_s=3.0), python=sandbox_python)
    assert r.timed_out and time.monotonic() - t0 < 10
    group = int(r.stdout.split()[0])
    time.sleep(0.2)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == group and not _gone(int(p))]


def test_sandbox_kills_leftover_children_without_waiting_for_the_time_limit(sandbox_python):
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    print(os.getpid())\n"
    t0 = time.monotonic()
    r = run_python(code, SandboxLimits(wall_s=20), python=sandbox_python)
    assert time.monotonic() - t0 < 5 and not r.timed_out and r.returncode == 0
    main_pid = int(r.stdout)
    time.sleep(0.2)
    children = [p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == main_pid]
    assert not [p for p in children if not _gone(int(p))]


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[2])  # the process group
    except (FileNotFoundError, IndexError, ValueError):
        return None


def test_sandbox_memory_file_size_and_output_limits(sandbox_python):
    limits = SandboxLimits(memory_mb=256, file_mb=1, output_chars=1000, wall_s=20)
    r = run_python("x = bytearray(1 << 30)\nprint('allocated')", limits, python=sandbox_python)
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout and r.returncode == 1

    code = textwrap.dedent("""
        import os
        try:
            with open("big", "wb") as f:
                f.write(b"x" * (8 << 20))
        except OSError as e:
            print(e.strerror)
        print(os.path.getsize("big"))
    """)
    r = run_python(code, limits, python=sandbox_python)
    assert r.stdout.split("\n")[:2] == ["File too large", str(1 << 20)], r

    r = run_python("print('a' * 100000)\nimport sys\nprint('b' * 5000, file=sys.stderr)", limits, python=sandbox_python)
    assert r.truncated and r.stdout.startswith("a" * 1000) and len(r.stdout) < 1100 and len(r.stderr) < 1100


def test_sandbox_cpu_and_wall_clock_limits(sandbox_python):
    limits = SandboxLimits(cpu_s=1, wall_s=30)
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", limits, python=sandbox_python)
    assert r.returncode == -signal.SIGXCPU and not r.timed_out and time.monotonic() - t0 < 20
    assert "CPU-time limit" in r.describe(limits)

    limits = SandboxLimits(wall_s=1)
    t0 = time.monotonic()
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", limits, python=sandbox_python)
    assert r.timed_out and r.stdout == "started\n" and time.monotonic() - t0 < 4
    assert "1s time limit" in r.describe(limits)


def test_sandbox_environment_is_empty_cwd_temporary_stdin_closed(sandbox_python, monkeypatch):
    monkeypatch.setenv("SPMDRL_SECRET_TOKEN", "hunter2")
    code = textwrap.dedent("""
        import json, os, sys
        try:
            input()
            stdin = "open"
        except EOFError:
            stdin = "eof"
        print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "files": os.listdir("."), "stdin": stdin,
                          "uid": os.getuid(), "path0": sys.path[0], "flags": sys.flags.isolated}))
    """)
    r = run_python(code, python=sandbox_python)
    info = json.loads(r.stdout)
    assert set(info["env"]) <= {"LC_CTYPE"}  # Python's own locale coercion (PEP 538) is all there is
    assert os.path.basename(info["cwd"]).startswith("spmdrl-sandbox-") and info["files"] == ["main.py"]
    assert not os.path.exists(info["cwd"])  # removed after the run
    assert info["stdin"] == "eof" and info["flags"] == 1
    if os.geteuid() == 0:
        assert info["uid"] != 0  # root's programs run as nobody


def test_python_tool_through_the_runner(sandbox_python):
    mt = MultiTurnConfig(tools=["python"], sandbox_python=sandbox_python, sandbox_timeout_s=1.0, tool_timeout_s=5)
    runner = build_tool_runner(mt)
    res = runner.run([[ToolCall("python", {"code": "print(sum(range(101)))"}),
                       ToolCall("python", {"code": "import time\ntime.sleep(30)"}),
                       ToolCall("python", {"code": "raise SystemExit('bye')"})]])
    assert [r.failure for r in res[0]] == ["", "", ""]
    assert res[0][0].text == "5050"
    assert "1s time limit" in res[0][1].text
    assert res[0][2].text == "stderr:\nbye\n[exit status 1]"


# ---------------------------------------------------------------------------------------------- http_exec

class _Service(BaseHTTPRequestHandler):
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        if self.path == "/slow":
            time.sleep(3)
        if self.path == "/broken":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error\ntrace")
            return
        if self.path == "/run_code":
            code = body["code"]
            out = {"status": "Success", "run_result": {"status": "Finished", "return_code": 0,
                                                       "stdout": f"ran {len(code)} chars\n", "stderr": ""}}
        elif self.path == "/api/v2/execute":
            out = {"run": {"stdout": body["files"][0]["content"].upper(), "stderr": "warn", "code": 2, "signal": None}}
        else:
            out = ["not", "an", "object"]
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_exec_against_a_local_service(service):
    def runner_for(path, api="sandbox_fusion", timeout=2.0):
        mt = MultiTurnConfig(tools=["http_exec"], http_exec_url=service + path, http_exec_api=api,
                             http_exec_timeout_s=timeout, tool_timeout_s=10)
        return build_tool_runner(mt)

    code = "print(1 + 1)"
    assert runner_for("/run_code").run([[ToolCall("http_exec", {"code": code})]])[0][0].text == "ran 12 chars"
    assert _Service.requests[-1] == ("/run_code", {"code": code, "language": "python", "run_timeout": 2.0})
    r = runner_for("/api/v2/execute", api="piston").run([[ToolCall("http_exec", {"code": code})]])[0][0]
    assert r.text == "PRINT(1 + 1)\nstderr:\nwarn\n[exit status 2]"
    assert _Service.requests[-1][1]["language"] == "python"

    for path, needle in (("/broken", "HTTP 500: internal error trace"), ("/other", "not a JSON object"),
                         ("/slow", "timed out")):
        r = runner_for(path, timeout=0.5).run([[ToolCall("http_exec", {"code": code})]])[0][0]
        assert r.failure == "exception" and needle in r.text and "\n" not in r.text, r.text
    mt = MultiTurnConfig(tools=["http_exec"], http_exec_url="http://127.0.0.1:9/run_code", http_exec_timeout_s=1)
    r = build_tool_runner(mt).run([[ToolCall("http_exec", {"code": code})]])[0][0]
    assert r.failure == "exception" and "unreachable" in r.text


def test_builtin_tools_have_schemas_for_the_chat_template(sandbox_python):
    mt = MultiTurnConfig(sandbox_python=sandbox_python, http_exec_url="http://127.0.0.1:1/run_code")
    for t in (calculator_tool(mt), python_tool(mt), http_exec_tool(mt)):
        fn = t.schema()["function"]
        assert fn["name"] == t.name and fn["description"] and fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])


# ---------------------------------------------------------------------------------------------- tool processes

_HOSTILE = '''
import asyncio, os, re, signal, subprocess, sys, time


def add(a: int, b: int) -> str:
    """Add.

    Args:
        a: a
        b: b
    """
    return str(a + b)


def backtrack(n: int) -> str:
    """A regex that backtracks in C, holding the GIL (2**n steps).

    Args:
        n: the length
    """
    return str(bool(re.match("(a+)+$", "a" * n + "b")))


def spawn(linger: float = 0.0) -> str:
    """Start a plain child, a new-session child and a double-forked grandchild, all sleeping a minute.

    Args:
        linger: seconds to sleep afterwards
    """
    plain = subprocess.Popen(["sleep", "60"])
    session = subprocess.Popen(["sleep", "61"], start_new_session=True)
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        grand = os.fork()
        if grand == 0:
            os.setsid()
            time.sleep(62)
            os._exit(0)
        os.write(w, str(grand).encode())
        os._exit(0)
    os.waitpid(middle, 0)
    grand = int(os.read(r, 32))
    time.sleep(linger)
    return f"{plain.pid} {session.pid} {grand}"


def die(code: int) -> str:
    """os._exit.

    Args:
        code: the exit status
    """
    os._exit(code)


def term() -> str:
    """SIGTERM to its own process."""
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    return "alive"


def close_stdout() -> str:
    """Close sys.stdout."""
    sys.stdout.close()
    return "closed"


def printer() -> str:
    """Print, then answer."""
    print("printed")
    return "answer"


def exits() -> str:
    """sys.exit."""
    sys.exit(3)


def interrupt() -> str:
    """Ctrl-C."""
    raise KeyboardInterrupt


async def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


async def block(n: int) -> str:
    """Block the event loop in C.

    Args:
        n: the regex length
    """
    return str(bool(re.match("(a+)+$", "a" * n + "b")))
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "hostile_tools.py"
    path.write_text(_HOSTILE)
    names = ["add", "backtrack", "spawn", "die", "term", "close_stdout", "printer", "exits", "interrupt", "nap",
             "block"]
    return load_tools([f"{path}:{n}" for n in names])


def _pids_gone(pids, within_s=2.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def test_a_tool_stuck_in_c_code_is_cut_at_its_timeout_and_the_run_goes_on(hostile):
    runner = ThreadToolRunner(hostile, timeout_s=1.0, max_parallel=4)
    warm = runner.run([[ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 0, "b": 3})]])  # two workers up
    assert [r.text for r in warm[0]] == ["3", "3"]
    t0 = time.monotonic()
    res = runner.run([[ToolCall("backtrack", {"n": 29}), ToolCall("add", {"a": 2, "b": 2})]])  # minutes in C
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 1.0, elapsed
    assert [r.failure for r in res[0]] == ["timeout", ""] and res[0][1].text == "4"
    assert "1s" in res[0][0].text
    assert runner.run([[ToolCall("add", {"a": 5, "b": 5})]])[0][0].text == "10"  # on a fresh worker
    assert runner.run([[ToolCall("backtrack", {"n": 3})]])[0][0].text == "False"

    # async tools: concurrent on one worker; a call blocking its loop in C is cut, the next calls get a new one
    assert runner.run([[ToolCall("nap", {"seconds": 0.01})]])[0][0].ok  # the async worker has started
    t0 = time.monotonic()
    res = runner.run([[ToolCall("nap", {"seconds": 0.3})] for _ in range(4)])
    assert [r[0].text for r in res] == ["slept 0.3"] * 4 and time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert runner.run([[ToolCall("block", {"n": 29})]])[0][0].failure == "timeout"
    assert time.monotonic() - t0 < 2.0
    assert runner.run([[ToolCall("nap", {"seconds": 0.01})]])[0][0].text == "slept 0.01"
    m = runner.take_metrics()
    assert m["tools/failures/backtrack/timeout"] == 1 and m["tools/failures/block/timeout"] == 1
    runner.close()


def test_nothing_a_tool_starts_outlives_its_call(hostile):
    runner = ThreadToolRunner(hostile, timeout_s=3.0, max_parallel=4)
    res = runner.run([[ToolCall("spawn")], [ToolCall("spawn")]])
    pids = [int(p) for turn in res for p in turn[0].text.split()]
    assert len(pids) == 6
    assert _pids_gone(pids) is True  # plain, new-session and double-forked children of both calls
    # a call that times out: its worker and what it started go together
    res = runner.run([[ToolCall("spawn", {"linger": 30})]])
    assert res[0][0].failure == "timeout"
    deadline = time.monotonic() + 5.0  # the kill is sent at the timeout; a loaded machine reaps a moment later
    while True:
        leftover = [p for p in os.listdir("/proc") if p.isdigit() and not _gone(int(p)) and _cmdline(p)
                    in ("sleep 60", "sleep 61")]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leftover, leftover
    runner.close()


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_a_tool_that_exits_kills_or_closes_its_process_fails_that_call_only(hostile):
    runner = ThreadToolRunner(hostile, timeout_s=3.0, max_parallel=4)
    res = runner.run([[ToolCall("die", {"code": 7}), ToolCall("term"), ToolCall("exits"), ToolCall("interrupt")]])
    assert [r.failure for r in res[0]] == ["exception"] * 4
    assert "exit code 7" in res[0][0].text and "SIGTERM" in res[0][1].text
    assert res[0][2].text == "error: SystemExit: 3" and "KeyboardInterrupt" in res[0][3].text
    res = runner.run([[ToolCall("close_stdout")]])
    assert res[0][0].text == "closed"
    assert runner.run([[ToolCall("printer")]])[0][0].text == "answer"  # prints never reach the protocol
    assert runner.run([[ToolCall("add", {"a": 1, "b": 1})]])[0][0].text == "2"
    runner.close()


def test_the_python_sandbox_leaves_no_process_behind(sandbox_python):
    code = textwrap.dedent("""
        import os, time
        pids = []
        for session in (False, True):
            pid = os.fork()
            if pid == 0:
                if session:
                    os.setsid()
                time.sleep(60)
                os._exit(0)
            pids.append(pid)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            grand = os.fork()
            if grand == 0:
                os.setsid()
                time.sleep(60)
                os._exit(0)
            os.write(w, str(grand).encode())
            os._exit(0)
        os.waitpid(middle, 0)
        pids.append(int(os.read(r, 32)))
        print(" ".join(map(str, pids)))
    """)
    r = run_python(code, SandboxLimits(wall_s=20), python=sandbox_python)
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 3 and r.returncode == 0, r
    assert _pids_gone(pids) is True
    # the same at the wall-clock limit
    r = run_python(code + "time.sleep(60)\n", SandboxLimits(wall_s=1.5), python=sandbox_python)
    assert r.timed_out
    assert _pids_gone([int(p) for p in r.stdout.split()]) is True


@pytest.mark.skipif(os.geteuid() != 0, reason="network and mount namespaces need root here")
def test_the_sandbox_has_no_network_and_cannot_read_hidden_directories(sandbox_python):
    import socket
    import tempfile

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    secret = tempfile.mkdtemp(prefix="spmdrl-test-run-")  # readable by everyone, as a run directory often is
    try:
        os.chmod(secret, 0o755)
        with open(os.path.join(secret, "ckpt.txt"), "w") as f:
            f.write("weights")
        code = textwrap.dedent(f"""
            import os, socket
            try:
                socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), timeout=2)
                print("connected")
            except OSError as e:
                print("no network:", type(e).__name__)
            print(sorted(os.listdir({secret!r})))
        """)
        r = run_python(code, SandboxLimits(wall_s=10), python=sandbox_python, hidden=[secret])
        assert r.stdout.splitlines() == ["no network: OSError", "[]"], r
        r = run_python(code, SandboxLimits(wall_s=10), python=sandbox_python, hidden=[])
        assert r.stdout.splitlines()[1] == "['ckpt.txt']", r  # what is hidden is there to read otherwise
    finally:
        shutil.rmtree(secret)
        server.close()


def test_tool_workers_get_no_torch_distributed_or_torchrun_variables(tmp_path, monkeypatch):
    """A tool worker inherited the rank's control plane: MASTER_ADDR/PORT, RANK, torchrun's error file and its
    TORCHELASTIC_* settings (code reading them takes itself for a rank); the rest of the environment stays."""
    path = tmp_path / "env_tool.py"
    path.write_text(textwrap.dedent('''
        import json, os

        def environment() -> str:
            """The worker's environment variables."""
            return json.dumps(dict(os.environ))
    '''))
    rank = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
            "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0", "ROLE_RANK": "3", "ROLE_NAME": "default",
            "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"), "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    for k, v in {**rank, "SPMDRL_TEST_KEPT": "yes"}.items():
        monkeypatch.setenv(k, v)
    runner = ThreadToolRunner(load_tools([f"{path}:environment"]), timeout_s=20)
    seen = json.loads(runner.run([[ToolCall("environment")]])[0][0].text)
    runner.close()
    assert not set(rank) & set(seen), sorted(set(rank) & set(seen))
    assert not [k for k in seen if k.startswith("TORCHELASTIC_")]
    assert seen["SPMDRL_TEST_KEPT"] == "yes" and seen["PATH"] == os.environ["PATH"]
