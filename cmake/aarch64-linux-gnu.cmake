# CMake toolchain file: cross-compile for 64-bit ARM Linux with Debian's gcc-aarch64-linux-gnu
# (scripts/build_aarch64.sh; the binaries run on x86-64 under qemu-aarch64 user emulation).
# AARCH64_SYSROOT (default /usr/aarch64-linux-gnu, where Debian's libc6-dev-arm64-cross puts
# the target's libc) is also qemu's -L prefix.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

if(NOT AARCH64_SYSROOT)
    set(AARCH64_SYSROOT /usr/aarch64-linux-gnu)
endif()
set(CMAKE_FIND_ROOT_PATH ${AARCH64_SYSROOT})
# Programs from the host, libraries and headers from the target (and from the cross-built
# ggml, which the callers pass as absolute paths: BOTH lets find_package look there too).
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# try_run and tests run under qemu
find_program(AARCH64_QEMU NAMES qemu-aarch64 qemu-aarch64-static)
if(AARCH64_QEMU)
    set(CMAKE_CROSSCOMPILING_EMULATOR ${AARCH64_QEMU} -L ${AARCH64_SYSROOT})
endif()
