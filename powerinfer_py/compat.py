"""`import powerinfer_py.compat` switches a llama-cpp-python script over unchanged:
from then on `import llama_cpp` (and its submodules) resolve to PowerInfer-Py.

    import powerinfer_py.compat  # noqa: F401  (first line of the script)
    import llama_cpp
    llm = llama_cpp.Llama(model_path="model.gguf")  # a powerinfer_py.Llama

See powerinfer_py.install_as_llama_cpp() for the function form.
"""

from ._llama.aliases import is_installed, uninstall_llama_cpp
from .llama import install_as_llama_cpp

__all__ = ["install_as_llama_cpp", "is_installed", "uninstall_llama_cpp"]

install_as_llama_cpp()
