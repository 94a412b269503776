"""`spmdrl serve`: the agents' endpoint (agents/endpoint.py) for a trained model, without capture, so an agent or an
eval harness can be pointed at the model a run trained. One process, one rollout engine (tensor parallel size 1);
the engine is stepped in the main thread, requests arrive on the HTTP server's threads."""
from __future__ import annotations

import logging
import os
import threading

from spmdrl.agents.capture import ChatRender
from spmdrl.agents.endpoint import Endpoint, Limits
from spmdrl.agents.sessions import serve
from spmdrl.rollout.base import SamplingSpec

logger = logging.getLogger(__name__)


def model_dir(checkpoint: str, export_to: str | None = None) -> str:
    """An HF model directory as is; a checkpoint (or a run's output_dir: its latest) exported to `export_to`
    (default <the checkpoint's run>/serve_model, replacing an earlier export there)."""
    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        return checkpoint
    import shutil

    from spmdrl.checkpoint import find_checkpoint, read_manifest
    from spmdrl.export import export_hf

    path = find_checkpoint(checkpoint)
    if export_to is None:  # <run>/checkpoints/step_N -> <run>/serve_model
        parent = os.path.dirname(os.path.abspath(path))
        run = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
        export_to = os.path.join(run, "serve_model")
        shutil.rmtree(export_to, ignore_errors=True)
    lora = "adapter" in read_manifest(path)["engines"].get("actor", {})
    logger.info("exporting %s to %s", path, export_to)
    export_hf(path, export_to, merged=lora)
    return export_to


def serve_model(model: str, *, secret: str, port: int = 8000, spec: SamplingSpec, max_model_len: int = 2048,
                engine=None, engine_kind: str = "auto", limits: Limits | None = None, stop: threading.Event | None = None,
                on_ready=None, fmt: str = "hermes") -> None:
    """Serve `model` on 127.0.0.1:port until `stop` is set (or forever). engine: an engine already built on it
    (tests); on_ready(base_url) is called once the server listens."""
    own = engine is None
    if own:
        from spmdrl.rollout import build_engine

        engine = build_engine(engine_kind, model_path=model, max_model_len=max_model_len, seed=0, tp_size=1)
    tok = engine.tokenizer
    stop_ids = set(spec.stop_token_ids) | ({tok.eos_token_id} - {None})
    spec = SamplingSpec(n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                        max_tokens=spec.max_tokens, stop=list(spec.stop), stop_token_ids=sorted(stop_ids))
    if spec.max_tokens >= max_model_len:
        from spmdrl.errors import ConfigError

        raise ConfigError(f"--max-tokens {spec.max_tokens} leaves no room for a prompt in --max-model-len {max_model_len}")
    endpoint = Endpoint(ChatRender(tok), spec, stop_ids, secret, fmt=fmt, limits=limits, capture=False,
                        max_prompt_tokens=max_model_len - spec.max_tokens - 1, max_response_tokens=spec.max_tokens + 1)
    base = endpoint.start(port)
    logger.info("serving %s on %s/v1", model, base)
    if on_ready is not None:
        on_ready(base + "/v1")
    stop = stop or threading.Event()
    try:
        serve(engine, None, endpoint, stop.is_set)
    finally:
        endpoint.stop()
        if own:
            engine.close()
