"""Llama's chat family: the handlers built from the GGUF's chat templates, the chat_format
guess, and create_chat_completion.

The handlers are llama-cpp-python's own (llama_cpp.llama_chat_format): they format
the messages (Jinja2 for GGUF templates), then call llama.tokenize and
llama.create_completion, which is all they need from a Llama. Multimodal handlers
(Llava15ChatHandler and relatives) drive a libllama context directly and only run on
the fallback engine.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, Optional

from . import generation, tokenizer, upstream


def setup(llama: Any, chat_format: Optional[str], chat_handler: Optional[Any]) -> None:
    """Set chat_format, chat_handler and _chat_handlers as llama_cpp.Llama.__init__ does."""
    llama.chat_format = chat_format
    llama.chat_handler = chat_handler
    llama._chat_handlers = {}
    metadata = llama.metadata

    # Named templates are tokenizer.chat_template.<name>, registered as chat_template.<name>.
    template_choices = {
        name[10:]: template for name, template in metadata.items() if name.startswith("tokenizer.chat_template.")
    }
    if "tokenizer.chat_template" in metadata:
        template_choices["chat_template.default"] = metadata["tokenizer.chat_template"]
    if llama.verbose and template_choices:
        print(f"Available chat formats from metadata: {', '.join(template_choices.keys())}", file=sys.stderr)

    if template_choices:
        chat_formats = upstream.llama_chat_format()
        eos_token_id, bos_token_id = llama.token_eos(), llama.token_bos()
        eos_token, bos_token = tokenizer.token_text(llama, eos_token_id), tokenizer.token_text(llama, bos_token_id)
        formatter = _formatter_class(chat_formats)
        for name, template in template_choices.items():
            llama._chat_handlers[name] = formatter(
                template=template,
                eos_token=eos_token,
                bos_token=bos_token,
                stop_token_ids=[eos_token_id],
            ).to_chat_handler()

        if llama.chat_format is None and llama.chat_handler is None and "chat_template.default" in template_choices:
            guessed = chat_formats.guess_chat_format_from_gguf_metadata(metadata)
            if guessed is not None:
                llama.chat_format = guessed
                if llama.verbose:
                    print(f"Guessed chat format: {guessed}", file=sys.stderr)
            else:
                if llama.verbose:
                    print(f"Using gguf chat template: {template_choices['chat_template.default']}", file=sys.stderr)
                    print(f"Using chat eos_token: {eos_token}", file=sys.stderr)
                    print(f"Using chat bos_token: {bos_token}", file=sys.stderr)
                llama.chat_format = "chat_template.default"

    if llama.chat_format is None and llama.chat_handler is None:
        llama.chat_format = "llama-2"
        if llama.verbose:
            print(f"Using fallback chat format: {llama.chat_format}", file=sys.stderr)


_FORMATTERS: Dict[int, type] = {}


def _formatter_class(chat_formats: Any) -> type:
    """llama-cpp-python's Jinja2ChatFormatter, whose stopping criterion (stop once the last
    evaluated token is one of the template's stop tokens) is a StopOnLastToken: the same
    test as upstream's closure, but one the core can run, so chats on ParallelLlama slots
    are sampled in the core (generation.StopOnLastToken)."""
    cls = _FORMATTERS.get(id(chat_formats))
    if cls is None:

        class Jinja2ChatFormatter(chat_formats.Jinja2ChatFormatter):
            def __call__(self, *args: Any, **kwargs: Any):
                result = super().__call__(*args, **kwargs)
                if self.stop_token_ids is not None:
                    criteria = upstream.module("llama").StoppingCriteriaList
                    result.stopping_criteria = criteria([generation.StopOnLastToken(self.stop_token_ids)])
                return result

        cls = _FORMATTERS[id(chat_formats)] = Jinja2ChatFormatter
    return cls


def _json_schema_grammar(response_format: Dict[str, Any], verbose: bool):
    """The grammar for OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}."""
    grammars = upstream.llama_grammar()
    spec = response_format.get("json_schema") or {}
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if schema is None:
        return grammars.LlamaGrammar.from_string(grammars.JSON_GBNF, verbose=verbose)
    return grammars.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=verbose)


def create_chat_completion(llama: Any, **kwargs: Any):
    """Llama.create_chat_completion: pick the handler as upstream and run it."""
    response_format = kwargs.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        # Upstream only constrains {"type": "json_object"}; OpenAI's json_schema form
        # gets the same treatment here instead of being ignored.
        if kwargs.get("grammar") is None:
            kwargs["grammar"] = _json_schema_grammar(response_format, verbose=llama.verbose)
        kwargs["response_format"] = None

    fallback = llama.__dict__.get("_fallback")
    if fallback is not None:
        return fallback.create_chat_completion(**kwargs)

    handler = (
        llama.chat_handler
        or llama._chat_handlers.get(llama.chat_format)
        or upstream.llama_chat_format().get_chat_completion_handler(llama.chat_format)
    )
    return handler(llama=llama, **kwargs)
