#!/usr/bin/env bash
# Set up (if needed), fetch the real test models and tokenizer fixtures, run the test suite.
# Usage: scripts/test.sh [pytest arguments, e.g. -k tokenizer -x]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

./scripts/setup.sh

# ggml's Vulkan backend as a loadable module, for the device tests on Mesa's software Vulkan
# (tests/test_device.py through tests/test_vulkan_backend.py; docs/hybrid.md#vulkan). Built
# once and cached; it needs apt packages (installed when running as root). Without them the
# device tests are skipped, unless POWERINFER_REQUIRE_VULKAN=1 (CI) makes that an error.
if [ "${POWERINFER_VULKAN:-1}" != 0 ]; then
    printf '\n==> %s\n' "Vulkan backend module (scripts/build_vulkan.sh)"
    if ! ./scripts/build_vulkan.sh; then
        if [ "${POWERINFER_REQUIRE_VULKAN:-0}" = 1 ]; then
            echo "error: the Vulkan backend module could not be built (POWERINFER_REQUIRE_VULKAN=1)" >&2
            exit 1
        fi
        echo "warning: no Vulkan backend module: the device tests will be skipped" >&2
    fi
fi

# The aarch64 kernel levels (scalar, dotprod), cross-built on x86-64 for tests/test_input_sparse.py
# and tests/test_sparse_ops.py, which run them under qemu-aarch64 (scripts/build_aarch64.sh; its
# ggml is built once and cached, the cross tools are apt packages, installed when running as
# root). Without them those levels are skipped, unless POWERINFER_REQUIRE_AARCH64=1 (CI) makes
# that an error. POWERINFER_AARCH64=0 leaves them out.
if [ "${POWERINFER_AARCH64:-1}" != 0 ] && [ "$(uname -m)" = x86_64 ]; then
    printf '\n==> %s\n' "aarch64 kernel test drivers (scripts/build_aarch64.sh)"
    if ! ./scripts/build_aarch64.sh; then
        if [ "${POWERINFER_REQUIRE_AARCH64:-0}" = 1 ]; then
            echo "error: the aarch64 test drivers could not be built (POWERINFER_REQUIRE_AARCH64=1)" >&2
            exit 1
        fi
        echo "warning: no aarch64 test drivers: the aarch64 kernel levels will not be tested" >&2
    fi
fi

# Debian's headless Chromium and its chromedriver, for the chat page's browser test
# (tests/test_server_apis.py, through selenium; nothing is downloaded at test time). apt
# packages, installed when running as root. Without them that test is skipped, unless
# POWERINFER_REQUIRE_CHROMIUM=1 (CI) makes that an error. POWERINFER_CHROMIUM=0 leaves them out.
if [ "${POWERINFER_CHROMIUM:-1}" != 0 ]; then
    printf '\n==> %s\n' "headless Chromium for the chat page's test (apt: chromium chromium-driver)"
    if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
        echo "    $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
    elif command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] &&
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; then
        echo "    installed: $(/usr/bin/chromium --version 2>/dev/null || echo chromium)"
    elif [ "${POWERINFER_REQUIRE_CHROMIUM:-0}" = 1 ]; then
        echo "error: chromium and chromium-driver could not be installed (POWERINFER_REQUIRE_CHROMIUM=1)" >&2
        exit 1
    else
        echo "warning: no chromium/chromedriver: the chat page's browser test will be skipped" >&2
    fi
fi

printf '\n==> %s\n' "test assets (models + llama.cpp tokenizer fixtures)"
.venv/bin/python -m powerinfer_py.assets.models fetch all
.venv/bin/python -m powerinfer_py.assets.models vocab-fixtures

printf '\n==> %s\n' "pytest"
exec .venv/bin/python -m pytest -q tests "$@"
