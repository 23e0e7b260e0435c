"""ggml's Vulkan backend as a loadable module, on a real Vulkan API (issue 30).

scripts/build_vulkan.sh builds libggml-vulkan.so (a GGML_BACKEND_DL module) from the
llama-cpp-python sdist's ggml against the installed wheel's libggml-base.so; the CPU wheel
is unchanged. These tests load it with ggml_backend_load() and check, on whatever Vulkan
device is visible (Mesa's software lavapipe in CI, see docs/hybrid.md#vulkan), that it lists
its device, reports memory, allocates a buffer there and computes ggml_mul_mat like the
CPU backend does, and record which of the ops our graphs use it supports.

The check runs in a child process (this file run as a script): once the module is loaded
into a process, ggml's device list holds the Vulkan device for everyone in it, and
llama-cpp-python's reference instances in the test session must stay on the CPU.

Skipped when the module is not built (scripts/setup.sh --vulkan, or
scripts/build_vulkan.sh) or when no Vulkan device is visible. POWERINFER_VULKAN_MODULE
names a module to use instead of the cached one.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO_DIR = Path(__file__).resolve().parent.parent

# What lavapipe needs, as in llama.cpp's own CI: ggml lists only discrete and integrated
# GPUs unless devices are named (lavapipe is a CPU-type device), and lavapipe's fp16 and
# cooperative-matrix paths are turned off.
LAVAPIPE_ENV = {"GGML_VK_VISIBLE_DEVICES": "0", "GGML_VK_DISABLE_F16": "1", "GGML_VK_DISABLE_COOPMAT": "1"}

# ggml_type values (ggml.h)
F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, I32, I64, BF16 = 0, 1, 2, 3, 8, 12, 14, 26, 27, 30
TYPE_NAMES = {F32: "f32", F16: "f16", Q4_0: "q4_0", Q4_1: "q4_1", Q8_0: "q8_0", Q4_K: "q4_K",
              Q6_K: "q6_K", BF16: "bf16"}
# Normalized RMS difference allowed between the Vulkan and the CPU result of a mul_mat.
# Both read the same quantized weights; the CPU quantizes x to Q8 for the dot products
# (Vulkan without integer dot products keeps x in f32), which the quantized types' bound
# covers; f16 also rounds x to f16 on the CPU.
TOLERANCE = {F32: 1e-5, F16: 2e-3, BF16: 1e-2, Q8_0: 1e-2, Q4_0: 1e-2, Q4_1: 1e-2, Q4_K: 1e-2, Q6_K: 1e-2}


def module_path() -> Optional[str]:
    env = os.environ.get("POWERINFER_VULKAN_MODULE")
    if env:
        return env if os.path.isfile(env) else None
    try:
        out = subprocess.run([str(REPO_DIR / "scripts" / "build_vulkan.sh"), "--print-path"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    return path if path and os.path.isfile(path) else None


# =========================================================================== the child
def _ggml_lib_dir() -> str:
    import llama_cpp

    return os.path.join(os.path.dirname(os.path.dirname(llama_cpp.__file__)), "lib")


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _bind(lib_dir: str):
    base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    ggml = ctypes.CDLL(os.path.join(lib_dir, "libggml.so"), mode=ctypes.RTLD_GLOBAL)
    P, S, I64, I, F, B = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_bool
    sigs = {
        # libggml: the registry
        "ggml_backend_load": (ggml, P, [ctypes.c_char_p]),
        "ggml_backend_reg_name": (ggml, ctypes.c_char_p, [P]),
        "ggml_backend_reg_dev_count": (ggml, S, [P]),
        "ggml_backend_reg_dev_get": (ggml, P, [P, S]),
        "ggml_backend_dev_count": (ggml, S, []),
        "ggml_backend_dev_get": (ggml, P, [S]),
        "ggml_backend_dev_by_type": (ggml, P, [I]),
        # libggml-base
        "ggml_backend_dev_name": (base, ctypes.c_char_p, [P]),
        "ggml_backend_dev_description": (base, ctypes.c_char_p, [P]),
        "ggml_backend_dev_type": (base, I, [P]),
        "ggml_backend_dev_memory": (base, None, [P, ctypes.POINTER(S), ctypes.POINTER(S)]),
        "ggml_backend_dev_init": (base, P, [P, ctypes.c_char_p]),
        "ggml_backend_dev_supports_op": (base, B, [P, P]),
        "ggml_backend_free": (base, None, [P]),
        "ggml_backend_name": (base, ctypes.c_char_p, [P]),
        "ggml_backend_alloc_ctx_tensors": (base, P, [P, P]),
        "ggml_backend_buffer_name": (base, ctypes.c_char_p, [P]),
        "ggml_backend_buffer_get_size": (base, S, [P]),
        "ggml_backend_buffer_is_host": (base, B, [P]),
        "ggml_backend_buffer_free": (base, None, [P]),
        "ggml_backend_tensor_set": (base, None, [P, P, S, S]),
        "ggml_backend_tensor_get": (base, None, [P, P, S, S]),
        "ggml_backend_graph_compute": (base, I, [P, P]),
        "ggml_init": (base, P, [_InitParams]),
        "ggml_free": (base, None, [P]),
        "ggml_new_tensor_1d": (base, P, [P, I, I64]),
        "ggml_new_tensor_2d": (base, P, [P, I, I64, I64]),
        "ggml_new_tensor_3d": (base, P, [P, I, I64, I64, I64]),
        "ggml_nbytes": (base, S, [P]),
        "ggml_row_size": (base, S, [I, I64]),
        "ggml_new_graph": (base, P, [P]),
        "ggml_build_forward_expand": (base, None, [P, P]),
        "ggml_quantize_chunk": (base, S, [I, P, P, I64, I64, I64, P]),
        "ggml_mul_mat": (base, P, [P, P, P]),
        "ggml_add": (base, P, [P, P, P]),
        "ggml_mul": (base, P, [P, P, P]),
        "ggml_relu": (base, P, [P, P]),
        "ggml_silu": (base, P, [P, P]),
        "ggml_gelu": (base, P, [P, P]),
        "ggml_abs": (base, P, [P, P]),
        "ggml_step": (base, P, [P, P]),
        "ggml_scale_bias": (base, P, [P, P, F, F]),
        "ggml_rms_norm": (base, P, [P, P, F]),
        "ggml_norm": (base, P, [P, P, F]),
        "ggml_swiglu_split": (base, P, [P, P, P]),
        "ggml_reglu_split": (base, P, [P, P, P]),
        "ggml_geglu_split": (base, P, [P, P, P]),
        "ggml_rope_ext": (base, P, [P, P, P, P, I, I, I, F, F, F, F, F, F]),
        "ggml_soft_max_ext": (base, P, [P, P, P, F, F]),
        "ggml_flash_attn_ext": (base, P, [P, P, P, P, P, F, F, F]),
        "ggml_prec_set_acc": (base, B, [P, I]),
        "ggml_get_rows": (base, P, [P, P, P]),
        "ggml_set_rows": (base, P, [P, P, P, P]),
        "ggml_cpy": (base, P, [P, P, P]),
        "ggml_cont": (base, P, [P, P]),
        "ggml_cont_2d": (base, P, [P, P, I64, I64]),
        "ggml_permute": (base, P, [P, P, I, I, I, I]),
        "ggml_view_3d": (base, P, [P, P, I64, I64, I64, S, S, S]),
        "ggml_reshape_2d": (base, P, [P, P, I64, I64]),
        "ggml_custom_4d": (base, P, [P, I, I64, I64, I64, I64, P, I, P, I, P]),
    }
    ns = {}
    for name, (lib, res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
        ns[name] = fn
    return type("ggml", (), ns)


def _devices(g) -> List[Dict]:
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        out.append({"name": g.ggml_backend_dev_name(d).decode(),
                    "description": g.ggml_backend_dev_description(d).decode(),
                    "type": ["CPU", "GPU", "IGPU", "ACCEL", "META"][g.ggml_backend_dev_type(d)]})
    return out


def _quantized(g, typ: int, w):
    """The bytes of w [rows, n_per_row] (float32) in ggml type typ."""
    import numpy as np

    rows, n = w.shape
    if typ == F32:
        return np.ascontiguousarray(w, dtype=np.float32).tobytes()
    if typ == F16:
        return np.ascontiguousarray(w, dtype=np.float16).tobytes()
    buf = ctypes.create_string_buffer(g.ggml_row_size(typ, n) * rows)
    src = np.ascontiguousarray(w, dtype=np.float32)
    g.ggml_quantize_chunk(typ, src.ctypes.data, ctypes.addressof(buf), 0, rows, n, None)
    return buf.raw


def _mul_mat(g, backend, typ: int, wbytes: bytes, x, n_rows: int):
    """ggml_mul_mat(w [K x n_rows] of type typ, x [K x M] f32) computed on backend."""
    import numpy as np

    m, k = x.shape
    ctx = g.ggml_init(_InitParams(64 * 1024 * 1024 // 64, None, True))
    w_t = g.ggml_new_tensor_2d(ctx, typ, k, n_rows)
    x_t = g.ggml_new_tensor_2d(ctx, F32, k, m)
    y_t = g.ggml_mul_mat(ctx, w_t, x_t)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, y_t)
    buf = g.ggml_backend_alloc_ctx_tensors(ctx, backend)
    assert buf, "ggml_backend_alloc_ctx_tensors failed"
    info = {"buffer": g.ggml_backend_buffer_name(buf).decode(), "buffer_size": g.ggml_backend_buffer_get_size(buf),
            "buffer_is_host": bool(g.ggml_backend_buffer_is_host(buf))}
    assert g.ggml_nbytes(w_t) == len(wbytes)
    wb = ctypes.create_string_buffer(wbytes, len(wbytes))
    g.ggml_backend_tensor_set(w_t, ctypes.addressof(wb), 0, len(wbytes))
    xs = np.ascontiguousarray(x, dtype=np.float32)
    g.ggml_backend_tensor_set(x_t, xs.ctypes.data, 0, xs.nbytes)
    status = g.ggml_backend_graph_compute(backend, gf)
    y = np.zeros((m, n_rows), dtype=np.float32)
    if status == 0:
        g.ggml_backend_tensor_get(y_t, y.ctypes.data, 0, y.nbytes)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)
    info["status"] = status
    return y, info


def _supports_table(g, dev) -> Dict[str, bool]:
    """ggml_backend_dev_supports_op on the ops (and types) our graphs build."""
    ctx = g.ggml_init(_InitParams(16 * 1024 * 1024, None, True))
    t1, t2, t3 = (lambda *a: g.ggml_new_tensor_1d(ctx, *a)), (lambda *a: g.ggml_new_tensor_2d(ctx, *a)), \
        (lambda *a: g.ggml_new_tensor_3d(ctx, *a))
    K, N, M, head, n_head, n_kv_head, n_kv = 256, 512, 8, 64, 4, 2, 256
    x = t2(F32, K, M)
    ops: Dict[str, int] = {}
    for typ in (F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K):
        ops[f"mul_mat {TYPE_NAMES[typ]} x f32 (M={M})"] = g.ggml_mul_mat(ctx, t2(typ, K, N), x)
        ops[f"mul_mat {TYPE_NAMES[typ]} x f32 (M=1)"] = g.ggml_mul_mat(ctx, t2(typ, K, N), t2(F32, K, 1))
    h = t2(F32, N, M)
    ops["add f32"] = g.ggml_add(ctx, h, t2(F32, N, M))
    ops["add f32 (broadcast row)"] = g.ggml_add(ctx, h, t1(F32, N))
    ops["mul f32 (broadcast row)"] = g.ggml_mul(ctx, h, t1(F32, N))
    ops["rms_norm f32"] = g.ggml_rms_norm(ctx, h, 1e-6)
    ops["norm f32"] = g.ggml_norm(ctx, h, 1e-5)
    for name in ("relu", "silu", "gelu", "abs", "step"):
        ops[f"{name} f32"] = getattr(g, "ggml_" + name)(ctx, h)
    ops["scale_bias f32"] = g.ggml_scale_bias(ctx, h, -1.0, 0.5)
    for name in ("swiglu_split", "reglu_split", "geglu_split"):
        ops[f"{name} f32"] = getattr(g, "ggml_" + name)(ctx, h, t2(F32, N, M))
    q = t3(F32, head, n_head, M)
    pos = t1(I32, M)
    ops["rope_ext f32 (normal)"] = g.ggml_rope_ext(ctx, q, pos, None, head, 0, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    ops["rope_ext f32 (neox)"] = g.ggml_rope_ext(ctx, q, pos, None, head, 2, 4096, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    # Attention as graph.c builds it: an F16 cache [n_embd_kv, n_ctx], K and V as 3-d views.
    n_embd_kv = head * n_kv_head
    kc, vc = t2(F16, n_embd_kv, n_kv), t2(F16, n_embd_kv, n_kv)
    vt = t2(F16, n_kv, n_embd_kv)
    row = g.ggml_row_size(F16, n_embd_kv)
    qp = g.ggml_permute(ctx, q, 0, 2, 1, 3)
    kk = g.ggml_view_3d(ctx, kc, head, n_kv, n_kv_head, row, g.ggml_row_size(F16, head), 0)
    vv = g.ggml_view_3d(ctx, vc, head, n_kv, n_kv_head, row, g.ggml_row_size(F16, head), 0)
    vvt = g.ggml_view_3d(ctx, vt, n_kv, head, n_kv_head, g.ggml_row_size(F16, n_kv),
                         g.ggml_row_size(F16, n_kv) * head, 0)
    kq = g.ggml_mul_mat(ctx, kk, qp)
    g.ggml_prec_set_acc(kq, 10)
    ops["mul_mat f16 K-view x permuted q (KQ)"] = kq
    for mtype in (F32, F16):
        ops[f"soft_max_ext f32, {TYPE_NAMES[mtype]} mask"] = g.ggml_soft_max_ext(ctx, kq, t2(mtype, n_kv, M), 0.125, 0.0)
    ops["mul_mat f16 V^T-view x f32 (KQV)"] = g.ggml_mul_mat(ctx, vvt, t3(F32, n_kv, M, n_head))
    fa = g.ggml_flash_attn_ext(ctx, qp, kk, vv, t2(F16, n_kv, M), 0.125, 0.0, 0.0)
    g.ggml_prec_set_acc(fa, 10)
    ops["flash_attn_ext f32 q, f16 K/V, f16 mask"] = fa
    ops["cont_2d (permuted f32)"] = g.ggml_cont_2d(ctx, g.ggml_permute(ctx, t3(F32, head, M, n_head), 0, 2, 1, 3),
                                                   head * n_head, M)
    ops["cpy f32 -> f16"] = g.ggml_cpy(ctx, h, t2(F16, N, M))
    ops["set_rows f32 -> f16 cache (i64 idx)"] = g.ggml_set_rows(ctx, kc, t2(F32, n_embd_kv, M), t1(I64, M))
    ops["set_rows f32 -> f16 cache (i32 idx)"] = g.ggml_set_rows(ctx, kc, t2(F32, n_embd_kv, M), t1(I32, M))
    ops["set_rows f32 -> f16 V^T (1-wide rows)"] = g.ggml_set_rows(
        ctx, g.ggml_reshape_2d(ctx, vt, 1, n_kv * n_embd_kv), t2(F32, 1, n_embd_kv * M), t1(I64, n_embd_kv * M))
    for typ in (F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K):
        ops[f"get_rows {TYPE_NAMES[typ]}"] = g.ggml_get_rows(ctx, t2(typ, K, 1000), t1(I32, M))
    # Our own operators (sparse FFN, packed matmul, the invariant attention): ggml_custom_4d.
    fn_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    noop = fn_t(lambda *a: None)
    args = (ctypes.c_void_p * 1)(h)
    ops["custom_4d (our sparse operators)"] = g.ggml_custom_4d(ctx, F32, N, M, 1, 1, args, 1,
                                                               ctypes.cast(noop, ctypes.c_void_p), 1, None)
    table = {name: bool(g.ggml_backend_dev_supports_op(dev, t)) for name, t in ops.items()}
    g.ggml_free(ctx)
    return table


def _check(module: str) -> Dict:
    import numpy as np

    g = _bind(_ggml_lib_dir())
    res: Dict = {"devices_before": _devices(g)}
    reg = g.ggml_backend_load(module.encode())
    if not reg:
        res["error"] = "ggml_backend_load returned NULL"
        return res
    res["reg"] = g.ggml_backend_reg_name(reg).decode()
    res["devices_after"] = _devices(g)
    n = g.ggml_backend_reg_dev_count(reg)
    res["n_devices"] = n
    if n == 0:
        return res
    dev = g.ggml_backend_reg_dev_get(reg, 0)
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    res["device"] = {"name": g.ggml_backend_dev_name(dev).decode(),
                     "description": g.ggml_backend_dev_description(dev).decode(),
                     "type": ["CPU", "GPU", "IGPU", "ACCEL", "META"][g.ggml_backend_dev_type(dev)],
                     "memory_free": free.value, "memory_total": total.value}
    res["supports_op"] = _supports_table(g, dev)

    vk = g.ggml_backend_dev_init(dev, None)
    cpu = g.ggml_backend_dev_init(g.ggml_backend_dev_by_type(0), None)
    res["backends"] = [g.ggml_backend_name(vk).decode(), g.ggml_backend_name(cpu).decode()]
    rng = np.random.default_rng(30)
    k, n_rows = 512, 96
    w = rng.standard_normal((n_rows, k)).astype(np.float32)
    res["mul_mat"] = []
    for typ in (F32, F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K):
        wbytes = _quantized(g, typ, w)
        for m in (1, 7):
            x = rng.standard_normal((m, k)).astype(np.float32)
            y_vk, info = _mul_mat(g, vk, typ, wbytes, x, n_rows)
            y_cpu, _ = _mul_mat(g, cpu, typ, wbytes, x, n_rows)
            y_ref = x.astype(np.float64) @ w.astype(np.float64).T  # the unquantized product
            nrmse = float(np.linalg.norm(y_vk - y_cpu) / np.linalg.norm(y_cpu))
            res["mul_mat"].append({"type": TYPE_NAMES[typ], "m": m, "nrmse_vs_cpu": nrmse,
                                   "nrmse_cpu_vs_f64": float(np.linalg.norm(y_cpu - y_ref) / np.linalg.norm(y_ref)),
                                   "finite": bool(np.isfinite(y_vk).all()), "tolerance": TOLERANCE[typ], **info})
    g.ggml_backend_free(vk)
    g.ggml_backend_free(cpu)
    return res


# =========================================================================== the tests
@pytest.fixture(scope="module")
def vk_result() -> Dict:
    module = module_path()
    skip = pytest.fail if os.environ.get("POWERINFER_REQUIRE_VULKAN") == "1" else pytest.skip  # CI: never skipped
    if module is None:
        skip("the Vulkan backend module is not built (scripts/setup.sh --vulkan or scripts/build_vulkan.sh)")
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in LAVAPIPE_ENV.items()}}
    out = subprocess.run([sys.executable, __file__, module], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        pytest.fail(f"the Vulkan check exited with {out.returncode}:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["module"] = module
    res["stderr"] = out.stderr
    if res.get("error"):
        pytest.fail(res["error"] + "\n" + out.stderr[-4000:])
    if not res.get("n_devices"):
        skip("no Vulkan device is visible (install mesa-vulkan-drivers for lavapipe; "
                    f"GGML_VK_VISIBLE_DEVICES={env.get('GGML_VK_VISIBLE_DEVICES')})")
    return res


def test_cpu_wheel_has_no_vulkan(vk_result):
    """The reference wheel is the CPU build: Vulkan appears only once the module is loaded."""
    assert not any("vulkan" in d["name"].lower() for d in vk_result["devices_before"]), vk_result["devices_before"]
    assert any(d["name"].startswith("Vulkan") for d in vk_result["devices_after"])


def test_lists_the_device(vk_result):
    assert vk_result["reg"] == "Vulkan"
    dev = vk_result["device"]
    assert dev["name"] == "Vulkan0"
    assert dev["type"] in ("GPU", "IGPU")
    assert dev["description"]


def test_reports_memory(vk_result):
    dev = vk_result["device"]
    assert 0 < dev["memory_free"] <= dev["memory_total"], dev


def test_mul_mat_matches_cpu(vk_result):
    rows = vk_result["mul_mat"]
    assert rows
    bad = [r for r in rows if r["status"] != 0 or not r["finite"] or not r["nrmse_vs_cpu"] <= r["tolerance"]]
    assert not bad, json.dumps(bad, indent=1)
    for r in rows:  # the weights lived in a device buffer, not in host memory
        assert r["buffer"].startswith("Vulkan") and not r["buffer_is_host"], r


def test_supports_the_dense_ops(vk_result):
    """What our dense graphs need on the device; the custom operators stay on the CPU."""
    table = vk_result["supports_op"]
    needed = [name for name in table if name.startswith(("mul_mat q4_0", "mul_mat q8_0", "mul_mat f32", "mul_mat f16",
                                                         "rms_norm", "add", "mul ", "silu", "get_rows f32"))]
    missing = [name for name in needed if not table[name]]
    assert not missing, missing
    assert not table["custom_4d (our sparse operators)"]



@pytest.mark.parametrize("tests_file", ["test_device.py", "test_accel_hybrid.py"])
def test_the_device_tests_pass_on_vulkan(vk_result, tests_file):
    """tests/test_device.py (placement, parity with the CPU in dense, gate and predictor
    modes, budgets, parallel slots) and tests/test_accel_hybrid.py (llama.cpp's tensor
    overrides with the sparse module on the CPU side) in a child pytest with the module
    loaded through ggml's GGML_BACKEND_PATH: the process's device list then holds Vulkan0,
    which this session's llama-cpp-python references must not see."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in LAVAPIPE_ENV.items()},
           "GGML_BACKEND_PATH": vk_result["module"]}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          str(REPO_DIR / "tests" / tests_file)],
                         cwd=REPO_DIR, capture_output=True, text=True, env=env, timeout=1800)
    tail = "\n".join(line for line in out.stdout.splitlines() if not line.startswith("ggml_vulkan"))[-6000:]
    assert out.returncode == 0, tail + out.stderr[-3000:]
    assert " passed" in tail and "skipped" not in tail, tail

if __name__ == "__main__":
    if len(sys.argv) == 2:
        print(json.dumps(_check(sys.argv[1])))
    else:
        # A readable run: python tests/test_vulkan_backend.py (lavapipe's env set if unset).
        for k, v in LAVAPIPE_ENV.items():
            os.environ.setdefault(k, v)
        path = module_path()
        if path is None:
            sys.exit("the Vulkan backend module is not built: scripts/build_vulkan.sh")
        print(json.dumps(_check(path), indent=1))
