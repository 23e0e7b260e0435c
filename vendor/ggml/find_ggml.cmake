# find_ggml.cmake - locates ggml and libllama inside the installed llama-cpp-python
# (the pin is in vendor/ggml/PIN). No third-party source is built here: we link
# against the shared libraries that llama-cpp-python installed into site-packages.
#
# Inputs (all optional):
#   LLAMA_CPP_PYTHON_ROOT  site-packages dir holding llama_cpp/ (also read from the environment)
#   Python3_EXECUTABLE     interpreter whose site-packages to search
#   POWERINFER_GGML_ROOT   install prefix of a ggml built apart from llama-cpp-python (also
#                          read from the environment): ggml only, no libllama, so only
#                          targets that need no libllama build. scripts/build_aarch64.sh
#                          cross-builds the pinned sdist's ggml for aarch64 and points here.
# Outputs: targets ggml::ggml, ggml::ggml-base, ggml::ggml-cpu, llama (not with
#   POWERINFER_GGML_ROOT); variable POWERINFER_GGML_LIBDIR (directory of the shared
#   libraries, for RPATH).

file(STRINGS "${CMAKE_CURRENT_LIST_DIR}/PIN" _pin REGEX "^llama-cpp-python==")
string(REPLACE "llama-cpp-python==" "" POWERINFER_LLAMA_CPP_PYTHON_VERSION "${_pin}")

set(_howto "Install it first (AMX-safe flags, see README):\n  CFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' CXXFLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' pip install llama-cpp-python==${POWERINFER_LLAMA_CPP_PYTHON_VERSION}\nor run ./scripts/setup.sh, which builds and caches that wheel.")

if(NOT POWERINFER_GGML_ROOT AND DEFINED ENV{POWERINFER_GGML_ROOT})
    set(POWERINFER_GGML_ROOT "$ENV{POWERINFER_GGML_ROOT}")
endif()
if(POWERINFER_GGML_ROOT)
    find_package(ggml CONFIG REQUIRED PATHS "${POWERINFER_GGML_ROOT}/lib/cmake/ggml" NO_DEFAULT_PATH)
    set(POWERINFER_GGML_LIBDIR "${POWERINFER_GGML_ROOT}/lib")
    message(STATUS "PowerInfer-Py: ggml ${ggml_VERSION} from ${POWERINFER_GGML_ROOT} (no libllama)")
    return()
endif()

if(NOT LLAMA_CPP_PYTHON_ROOT AND DEFINED ENV{LLAMA_CPP_PYTHON_ROOT})
    set(LLAMA_CPP_PYTHON_ROOT "$ENV{LLAMA_CPP_PYTHON_ROOT}")
endif()

if(NOT LLAMA_CPP_PYTHON_ROOT)
    if(NOT Python3_EXECUTABLE)
        if(Python_EXECUTABLE)
            set(Python3_EXECUTABLE "${Python_EXECUTABLE}")
        else()
            set(Python3_FIND_VIRTUALENV FIRST)
            find_package(Python3 COMPONENTS Interpreter REQUIRED)
        endif()
    endif()
    # sysconfig reports the interpreter's (or virtualenv's) own purelib/platlib from
    # sys.prefix, which pip's build isolation leaves alone (it only edits sys.path).
    execute_process(
        COMMAND "${Python3_EXECUTABLE}" -c
                "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])"
        OUTPUT_VARIABLE _sp OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "Could not ask ${Python3_EXECUTABLE} for its site-packages.")
    endif()
    string(REPLACE "\n" ";" _sp "${_sp}")
    foreach(_dir IN LISTS _sp)
        if(EXISTS "${_dir}/llama_cpp/__init__.py")
            set(LLAMA_CPP_PYTHON_ROOT "${_dir}")
            break()
        endif()
    endforeach()
endif()

if(NOT LLAMA_CPP_PYTHON_ROOT OR NOT EXISTS "${LLAMA_CPP_PYTHON_ROOT}/llama_cpp/__init__.py")
    message(FATAL_ERROR "llama-cpp-python ${POWERINFER_LLAMA_CPP_PYTHON_VERSION} was not found "
                        "(searched the site-packages of ${Python3_EXECUTABLE}). ${_howto}")
endif()

file(STRINGS "${LLAMA_CPP_PYTHON_ROOT}/llama_cpp/__init__.py" _ver REGEX "^__version__")
string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" _ver "${_ver}")
if(NOT _ver STREQUAL POWERINFER_LLAMA_CPP_PYTHON_VERSION)
    message(FATAL_ERROR "Found llama-cpp-python ${_ver} in ${LLAMA_CPP_PYTHON_ROOT}, "
                        "but PowerInfer-Py is pinned to ${POWERINFER_LLAMA_CPP_PYTHON_VERSION}. ${_howto}")
endif()

find_package(ggml CONFIG REQUIRED PATHS "${LLAMA_CPP_PYTHON_ROOT}/lib/cmake/ggml" NO_DEFAULT_PATH)
find_package(llama CONFIG REQUIRED PATHS "${LLAMA_CPP_PYTHON_ROOT}/lib/cmake/llama" NO_DEFAULT_PATH)
set(POWERINFER_GGML_LIBDIR "${LLAMA_CPP_PYTHON_ROOT}/lib")
message(STATUS "PowerInfer-Py: ggml and libllama from llama-cpp-python ${_ver} in ${LLAMA_CPP_PYTHON_ROOT}")
