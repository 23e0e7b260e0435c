"""`python -m powerinfer_py.server --model PATH [...]`: serve one model over the OpenAI API.

The flags are `python -m llama_cpp.server`'s (0.3.36), generated from the settings'
fields: `--n_ctx 2048`, `--n_threads 4`, `--embedding true`, `--config_file cfg.json`...
Every flag also has a dashed spelling (`--n-ctx`, `--vram-budget`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Type, Union

_MISSING_EXTRA = (
    "powerinfer_py.server needs the 'server' extra ({missing} is missing):\n"
    "    pip install 'powerinfer-py[server]'   # fastapi, uvicorn, pydantic-settings"
)


def _base_type(annotation: Any) -> Any:
    """The scalar type argparse converts a flag's value to (llama_cpp.server.cli's rule)."""
    origin = getattr(annotation, "__origin__", None)
    args = getattr(annotation, "__args__", ())
    if origin is Literal:
        return type(args[0])
    if origin is Union:
        non_none = [a for a in args if a is not type(None)]
        return _base_type(non_none[0]) if non_none else str
    if origin in (list, List):
        return _base_type(args[0])
    return annotation


def _contains(annotation: Any, kinds: Tuple[Any, ...]) -> bool:
    origin = getattr(annotation, "__origin__", None)
    if origin in kinds:
        return True
    if origin in (Literal, Union):
        return any(_contains(a, kinds) for a in getattr(annotation, "__args__", ()))
    return False


def _parse_bool(arg: Union[str, bytes, bool]) -> bool:
    if isinstance(arg, bytes):
        arg = arg.decode("utf-8")
    value = str(arg).lower().strip()
    if value in {"1", "on", "t", "true", "y", "yes"}:
        return True
    if value in {"0", "off", "f", "false", "n", "no"}:
        return False
    raise argparse.ArgumentTypeError(f"Invalid boolean argument: {arg}")


def _parse_json_object(arg: str) -> Dict[str, Any]:
    value = json.loads(arg)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"Invalid JSON object argument: {arg}")
    return value


_SHUTDOWN_GRACE_S = 3

# llama.cpp's server spellings of some fields, beside llama_cpp.server's.
_ALIASES = {"rpc_servers": ["--rpc"], "override_tensor": ["-ot"], "cpu_moe": ["-cmoe"], "n_cpu_moe": ["-ncmoe"]}
# Flags that llama.cpp spells without a value (--cpu-moe); a value is still taken (--cpu-moe false).
_BARE_FLAGS = {"cpu_moe"}


def add_args_from_model(parser: argparse.ArgumentParser, model: Type[Any]) -> None:
    """One flag per field of the pydantic model, spelled `--field_name` and `--field-name`."""
    for name, field in model.model_fields.items():
        description = field.description
        if description and not field.is_required() and field.default is not None:
            description += f" (default: {field.default})"
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        flags += _ALIASES.get(name, [])
        annotation = field.annotation
        base = _base_type(annotation) if annotation is not None else str
        if _contains(annotation, (dict, Dict)):
            parser.add_argument(*flags, dest=name, type=_parse_json_object, help=description)
        elif base is bool:
            bare = dict(nargs="?", const=True) if name in _BARE_FLAGS else {}
            parser.add_argument(*flags, dest=name, type=_parse_bool, metavar="BOOL", help=description, **bare)
        else:
            parser.add_argument(
                *flags,
                dest=name,
                nargs="*" if _contains(annotation, (list, List)) else None,
                type=base,
                help=description,
            )


def _from_args(model: Type[Any], args: argparse.Namespace) -> Any:
    return model(**{k: v for k, v in vars(args).items() if v is not None and k in model.model_fields})


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        import uvicorn
    except ImportError:
        print(_MISSING_EXTRA.format(missing="uvicorn"), file=sys.stderr)
        return 1
    try:
        from .app import _settings_from_config_file, create_app  # says which extra is missing
    except ImportError as e:
        print(e, file=sys.stderr)
        return 1
    from .settings import ModelSettings, ServerSettings, Settings

    parser = argparse.ArgumentParser(
        prog="python -m powerinfer_py.server",
        description="PowerInfer-Py OpenAI-compatible server (flags of python -m llama_cpp.server).",
    )
    add_args_from_model(parser, Settings)
    parser.add_argument("--config_file", "--config-file", type=str, help="Path to a config file to load.")
    args = parser.parse_args(argv)

    try:
        config_file = os.environ.get("CONFIG_FILE", args.config_file)
        if config_file:
            server_settings, model_settings = _settings_from_config_file(config_file)
        else:
            server_settings = _from_args(ServerSettings, args)
            model_settings = [_from_args(ModelSettings, args)]
    except Exception as e:
        print(e, file=sys.stderr)
        parser.print_help(sys.stderr)
        return 1

    # CONFIG_FILE is read above; create_app must not read it again.
    os.environ.pop("CONFIG_FILE", None)
    server: Optional[Any] = None
    failed: List[BaseException] = []

    def on_load_error(exc: BaseException) -> None:
        # The server answers 503 until now; a model that cannot load ends it, non-zero.
        print(f"powerinfer_py.server: {exc}", file=sys.stderr)
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    try:
        # The model loads in the background; /health answers 503 until it is ready.
        app = create_app(server_settings=server_settings, model_settings=model_settings, load_in_background=True,
                         on_load_error=on_load_error)
    except (ValueError, OSError) as e:
        print(f"powerinfer_py.server: {e}", file=sys.stderr)
        return 1

    class Server(uvicorn.Server):
        """uvicorn's server; SIGTERM and SIGINT also end the open streams and running
        generations (ServerState.begin_shutdown): uvicorn waits for every response to end
        before it exits, and a stream ended only when its generation did (docker stop and
        systemd send SIGTERM, then kill)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            try:  # the handler runs on the main thread, which runs the event loop
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon_threadsafe(app.state.powerinfer.begin_shutdown)

    server = Server(
        uvicorn.Config(
            app,
            host=server_settings.host,
            port=server_settings.port,
            ssl_keyfile=server_settings.ssl_keyfile,
            ssl_certfile=server_settings.ssl_certfile,
            # After SIGTERM/SIGINT every generation is cancelled and streams end at once; what
            # still runs after this long (an embedding, say) is not waited for.
            timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        )
    )
    if failed:  # failed before the server existed
        return 1
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
