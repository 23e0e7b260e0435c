"""The placement plan on its own (src/powerinfer_c/placement_plan.c through the C driver
tests/c/test_placement_plan.c): random inputs over 1-3 devices against a reference of its
rules written here, the budgets checked on every device, and the FFN knapsack against a
brute force of every choice of prefixes."""

from __future__ import annotations

import itertools
import random
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

from conftest import REPO_DIR

DRIVER = Path(REPO_DIR) / "build" / "bin" / "test-placement-plan"
HOST = -1
NO_OUTPUT = 2**64 - 1  # PI_PLAN_NO_OUTPUT: a device that never takes the output (an RPC worker)
CLASSES = ("attn", "pred", "ffn_norm")


def _run(case: Dict) -> Dict[str, List[int]]:
    lines = [f"{case['mode']} {len(case['dev'])} {case['n_layer']} {case['ngl']}"]
    for d in case["dev"]:
        lines.append(f"{d['budget']} {d['reserve']} {d['share']} {d['output']}")
    for d in case["dev"]:
        for lb in d["layers"]:
            lines.append(" ".join(str(lb[k]) for k in ("attn", "pred", "ffn_norm", "ffn", "kv", "group")))
    lines.append(str(case["n_groups"]))
    lines.append(" ".join(str(v) for v in case["values"]) or "")
    lines.append(" ".join(str(c) for c in case["capacity"]))
    out = subprocess.run([str(DRIVER)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    plan = {}
    for line in out.stdout.splitlines():
        name, *vals = line.split()
        assert name != "error", line
        plan[name] = [int(v) for v in vals]
    return plan


def _fits(case, used, d, n):
    dv = case["dev"][d]
    return dv["reserve"] <= dv["budget"] and used[d] + n <= dv["budget"] - dv["reserve"]


def _reference_hybrid(case):
    """The hybrid rules: classes in order (attention by layer, predictors, ffn_norm, output),
    each on the current device or, when it is full, the next one with room; one that fits on
    none stops them. Then each device's layers' KV, all or none, once every class is placed."""
    n_layer, n_dev = case["n_layer"], len(case["dev"])
    plan = {k: [HOST] * n_layer for k in (*CLASSES, "ffn", "kv")}
    plan["output"] = [HOST]
    used = [0] * n_dev
    d, stopped = 0, False
    order = [(c, il) for c in CLASSES for il in range(n_layer)] + [("output", 0)]
    for cls, il in order:
        if stopped:
            break
        size = (lambda dd: case["dev"][dd]["output"]) if cls == "output" else (lambda dd: case["dev"][dd]["layers"][il][cls])
        if cls != "output" and size(0) == 0:
            continue
        if cls == "output":
            # A device that never takes the output is passed over; none left: it stays home.
            takes = lambda dd: case["dev"][dd]["output"] != NO_OUTPUT
            if not any(takes(dd) for dd in range(d, n_dev)):
                break
            while d < n_dev and not (takes(d) and _fits(case, used, d, size(d))):
                d += 1
        while d < n_dev and not _fits(case, used, d, size(d)):
            d += 1
        if d == n_dev:
            stopped = True
            break
        plan[cls][il] = d
        used[d] += size(d)
    dense_all = not stopped
    if dense_all:
        plan["ffn"] = list(plan["attn"])
        for dd in range(n_dev):
            kv = sum(case["dev"][dd]["layers"][il]["kv"] for il in range(n_layer) if plan["attn"][il] == dd)
            if kv > 0 and _fits(case, used, dd, kv):
                for il in range(n_layer):
                    if plan["attn"][il] == dd:
                        plan["kv"][il] = dd
                used[dd] += kv
    plan["dense_all"] = [int(dense_all)]
    plan["used"] = used
    return plan


def _brute_force_ffn(case, plan):
    """Per device, the best mass of any prefix choice within its capacity (exhaustive)."""
    n_layer, G = case["n_layer"], case["n_groups"]
    values = case["values"]
    best_mass = {}
    for d in range(len(case["dev"])):
        layers = [il for il in range(n_layer) if plan["ffn"][il] == d and case["dev"][d]["layers"][il]["group"] > 0]
        best = 0.0
        for ks in itertools.product(range(G + 1), repeat=len(layers)):
            cost = sum(k * case["dev"][d]["layers"][il]["group"] for k, il in zip(ks, layers))
            if cost <= case["capacity"][d]:
                best = max(best, sum(sum(values[il * G : il * G + k]) for k, il in zip(ks, layers)))
        best_mass[d] = best
    return best_mass


def _random_case(rng: random.Random, mode: int) -> Dict:
    n_dev, n_layer = rng.randint(1, 3), rng.randint(1, 4)
    predictor = rng.random() < 0.5
    dev = []
    for _ in range(n_dev):
        layers = [{"attn": rng.randint(1, 40), "pred": rng.randint(1, 10) if predictor else 0,
                   "ffn_norm": rng.randint(1, 3), "ffn": rng.randint(10, 80), "kv": rng.randint(0, 30),
                   "group": rng.choice([0, 5, 7, 10]) if mode == 0 else 0} for _ in range(n_layer)]
        dev.append({"budget": rng.randint(0, 300), "reserve": rng.randint(0, 40), "share": rng.choice([0.0, 0.0, 1.0, 2.5]),
                    "output": NO_OUTPUT if rng.random() < 0.25 else rng.randint(5, 60), "layers": layers})
    n_groups = 3 if mode == 0 else 0
    values = []
    for _ in range(n_layer * (1 if n_groups else 0)):
        values += sorted((round(rng.uniform(0, 10), 3) for _ in range(n_groups)), reverse=True)
    return {"mode": mode, "n_layer": n_layer, "ngl": rng.choice([-1, 0, 1, 2, n_layer, n_layer + 1]), "dev": dev,
            "n_groups": n_groups, "values": values, "capacity": [rng.randint(0, 40) for _ in range(n_dev)]}


@pytest.fixture(scope="module")
def driver():
    if not DRIVER.is_file():
        pytest.skip(f"{DRIVER} is not built (cmake --build build)")
    return DRIVER


def test_hybrid_plan_follows_the_rules_and_never_exceeds_a_budget(driver):
    rng = random.Random(29)
    for _ in range(300):
        case = _random_case(rng, 0)
        plan = _run(case)
        ref = _reference_hybrid(case)
        for key in (*CLASSES, "ffn", "kv", "output", "dense_all", "used"):
            assert plan[key] == ref[key], (key, case, plan, ref)
        for d, dv in enumerate(case["dev"]):
            assert plan["used"][d] + dv["reserve"] <= max(dv["budget"], dv["reserve"]) or plan["used"][d] == 0
        # The FFN groups: per device an optimum of its knapsack, prefixes only.
        best = _brute_force_ffn(case, plan)
        G = case["n_groups"]
        for d in range(len(case["dev"])):
            layers = [il for il in range(case["n_layer"]) if plan["ffn"][il] == d]
            cost = sum(plan["chosen"][il] * case["dev"][d]["layers"][il]["group"] for il in layers)
            mass = sum(sum(case["values"][il * G : il * G + plan["chosen"][il]]) for il in layers)
            assert cost <= case["capacity"][d], (case, plan)
            assert abs(mass - best[d]) < 1e-9, (d, mass, best[d], case, plan)
        for il in range(case["n_layer"]):
            if plan["ffn"][il] == HOST or case["dev"][plan["ffn"][il]]["layers"][il]["group"] == 0:
                assert plan["chosen"][il] == 0


def test_layer_split_is_contiguous_by_share_and_fits(driver):
    rng = random.Random(30)
    for _ in range(300):
        case = _random_case(rng, 1)
        plan = _run(case)
        n_layer, n_dev, ngl = case["n_layer"], len(case["dev"]), case["ngl"]
        n_off = n_layer if ngl < 0 or ngl > n_layer else ngl
        used = [0] * n_dev
        for il in range(n_layer):
            d = plan["attn"][il]
            assert plan["pred"][il] == plan["ffn_norm"][il] == plan["ffn"][il] == plan["kv"][il] == d
            if il < n_layer - n_off:
                assert d == HOST, (il, case, plan)  # only the last n_gpu_layers leave the host
            if d != HOST:
                lb = case["dev"][d]["layers"][il]
                used[d] += lb["attn"] + lb["pred"] + lb["ffn_norm"] + lb["ffn"] + lb["kv"]
        placed = [d for d in plan["attn"] if d != HOST]
        assert placed == sorted(placed), (case, plan)  # device ranges in order
        if plan["output"][0] != HOST:
            assert case["dev"][plan["output"][0]]["output"] != NO_OUTPUT, (case, plan)
            assert ngl < 0 or ngl > n_layer
            assert plan["output"][0] == plan["attn"][n_layer - 1]
            used[plan["output"][0]] += case["dev"][plan["output"][0]]["output"]
        assert plan["used"] == used
        for d, dv in enumerate(case["dev"]):
            assert used[d] == 0 or used[d] + dv["reserve"] <= dv["budget"], (d, case, plan)
        assert plan["dense_all"] == [0]


def test_layer_split_follows_the_shares_when_everything_fits(driver):
    """Ample budgets: shares 1:3 over 8 layers give the last 2 and the first 6 layers... in
    llama.cpp's order: the first device takes the first quarter of the offloaded layers."""
    layers = [{"attn": 1, "pred": 0, "ffn_norm": 1, "ffn": 1, "kv": 1, "group": 0} for _ in range(8)]
    dev = [{"budget": 10**6, "reserve": 0, "share": s, "output": 1, "layers": layers} for s in (1.0, 3.0)]
    plan = _run({"mode": 1, "n_layer": 8, "ngl": -1, "dev": dev, "n_groups": 0, "values": [], "capacity": [0, 0]})
    assert plan["attn"] == [0, 0, 1, 1, 1, 1, 1, 1] and plan["output"] == [1]
    plan = _run({"mode": 1, "n_layer": 8, "ngl": 4, "dev": dev, "n_groups": 0, "values": [], "capacity": [0, 0]})
    assert plan["attn"] == [HOST] * 4 + [0, 1, 1, 1] and plan["output"] == [HOST]


def test_a_device_that_never_takes_the_output_does_not_stop_the_classes(driver):
    """An RPC worker never takes the LM head (logits would cross the link every token): the
    output stays home, and the KV cache and FFN rows are still placed, in both modes."""
    layers = [{"attn": 1, "pred": 0, "ffn_norm": 1, "ffn": 1, "kv": 1, "group": 1} for _ in range(4)]
    dev = [{"budget": 10**6, "reserve": 0, "share": 0.0, "output": NO_OUTPUT, "layers": layers}]
    for mode in (0, 1):
        plan = _run({"mode": mode, "n_layer": 4, "ngl": -1, "dev": dev, "n_groups": 1, "values": [1.0] * 4,
                     "capacity": [10]})
        assert plan["output"] == [HOST] and plan["dense_all"] == [1 - mode], (mode, plan)  # layer split: 0
        assert plan["attn"] == plan["kv"] == plan["ffn"] == [0] * 4, (mode, plan)
    # With a second device that takes it, the output goes there (after the first is passed over).
    two = dev + [{"budget": 10**6, "reserve": 0, "share": 0.0, "output": 5, "layers": layers}]
    plan = _run({"mode": 0, "n_layer": 4, "ngl": -1, "dev": two, "n_groups": 1, "values": [1.0] * 4,
                 "capacity": [10, 10]})
    assert plan["output"] == [1] and plan["attn"] == [0] * 4 and plan["dense_all"] == [1], plan


def test_plan_rejects_bad_input(driver):
    layers = [{"attn": 2, "pred": 0, "ffn_norm": 1, "ffn": 1, "kv": 1, "group": 0}]
    case = {"mode": 0, "n_layer": 1, "ngl": 0, "dev": [{"budget": 1, "reserve": 0, "share": 0, "output": 1,
                                                           "layers": layers}], "n_groups": 0, "values": [], "capacity": [0]}
    assert _run(case)["attn"] == [HOST]  # nothing fits: every class on the host
    out = subprocess.run([str(DRIVER)], input="0 17 1 0\n", capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "bad header" in out.stdout
