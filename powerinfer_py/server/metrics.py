"""GET /metrics: Prometheus text from the server's and the engine's counters. Nothing here
waits for the model: the engine's counters are those of its last step."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .engine import ServerState

__all__ = ["metrics_text"]

# name (without the powerinfer_ prefix) -> (type, help), in the order printed.
_ENGINE_METRICS: Dict[str, Tuple[str, str]] = {
    "slots_busy": ("gauge", "Slots serving a request"),
    "tokens_generated_total": ("counter", "Tokens generated (one-token decode steps)"),
    "prompt_tokens_total": ("counter", "Prompt tokens computed"),
    "prompt_chunks_total": ("counter", "Pieces of prompts computed, one per step between the other slots' steps"),
    "prompt_tokens_cached_total": ("counter", "Prompt tokens taken from the prompt cache"),
    "decode_steps_total": ("counter", "Batches computed"),
    "busy_seconds_total": ("counter", "Seconds spent computing"),
    "step_seconds_max": ("gauge", "The longest batch computed, in seconds"),
    "decode_steps_restarted_total": ("counter", "Batches interrupted to take in a new request, then computed again"),
    "restart_seconds_total": ("counter", "Seconds of interrupted batches, thrown away"),
    "tokens_per_second": ("gauge", "Tokens computed per busy second"),
    "kv_cells_used": ("gauge", "KV cache cells in use"),
    "sparse_active_fraction": ("gauge", "Share of FFN neurons the sparse steps computed"),
    "draft_verify_steps_total": ("counter", "Speculative decoding: decodes that checked drafted tokens"),
    "draft_tokens_total": ("counter", "Speculative decoding: tokens drafted and checked"),
    "draft_tokens_accepted_total": ("counter", "Speculative decoding: drafted tokens accepted"),
    "draft_acceptance_rate": ("gauge", "Speculative decoding: accepted / drafted tokens"),
    "draft_tokens_per_step": ("gauge", "Speculative decoding: tokens generated per verify step"),
}


# Per layer, labelled layer="N": the counts behind the sparse active share (the rate of the
# first over the rate of the second is the share of the last interval).
_LAYER_METRICS = (
    ("sparse_layer_neurons_active_total",
     "FFN neurons the sparse steps computed, per layer (input mode: input entries read)"),
    ("sparse_layer_neurons_total", "FFN neurons the sparse steps considered, per layer (input mode: input entries)"),
)


def metrics_text(state: ServerState) -> str:
    rows: List[Tuple[str, str, str, float]] = []

    def add(name: str, kind: str, help_text: str, value: Optional[float]) -> None:
        if value is not None:
            rows.append((f"powerinfer_{name}", kind, help_text, float(value)))

    add("model_loaded", "gauge", "1 once the model is loaded", 0 if state.proxy is None else 1)
    add("requests_waiting", "gauge", "Requests queued for a slot (or the model lock)", state.requests_waiting())
    add("slots_total", "gauge", "Parallel slots (--n_parallel)", state.n_parallel)
    for name, value in state.stats.items():
        add(f"{name}_total", "counter", f"Server count: {name.replace('_', ' ')}", value)
    counters = state.engine.counters()
    for name, (kind, help_text) in _ENGINE_METRICS.items():
        add(name, kind, help_text, counters.get(name))
    out = []
    for name, kind, help_text, value in rows:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
    layers = counters.get("sparse_layers") or []
    if any(total for _, total in layers):  # a model that ran sparse steps (the page plots these)
        for k, (name, help_text) in enumerate(_LAYER_METRICS):
            out += [f"# HELP powerinfer_{name} {help_text}", f"# TYPE powerinfer_{name} counter"]
            out += [f'powerinfer_{name}{{layer="{il}"}} {counts[k]:g}' for il, counts in enumerate(layers)]
    return "\n".join(out) + "\n"
