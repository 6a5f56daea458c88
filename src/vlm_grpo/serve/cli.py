"""``vlm-grpo-serve`` / ``python -m vlm_grpo.serve``: start a listener or speaker service, or wait for one.

    vlm-grpo-serve listener --model PATH [--host 127.0.0.1] [--port 9000] [--image_root DIR ...] [--token T]
    vlm-grpo-serve speaker  --model PATH [--max_new_tokens 128] ...
    vlm-grpo-serve wait http://127.0.0.1:9000 [--timeout 300] [--pid PID]   # exits 0 once /health answers

Flags win over the environment (``INFERENCE_CONCURRENCY``, ``INFERENCE_ACQUIRE_TIMEOUT``, ``LISTENER_BATCH_SIZE``
/ ``SPEAKER_BATCH_SIZE``, ``VLM_GRPO_SERVE_TOKEN``, ``VLM_GRPO_SERVE_IMAGE_ROOTS``,
``VLM_GRPO_SERVE_MAX_*``: see :mod:`vlm_grpo.serve.settings`). The service binds 127.0.0.1
unless ``--host`` says otherwise; prefer the environment variable to ``--token`` (flags show up in ``ps``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from vlm_grpo.cli_errors import run_cli
from vlm_grpo.utils import is_loopback_host

logger = logging.getLogger("vlm_grpo.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-grpo-serve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role", required=True)
    for role in ("listener", "speaker"):
        p = sub.add_parser(role, help=f"serve a {role} model")
        p.add_argument("--model", required=True, help="checkpoint folder (any registered VLM family)")
        p.add_argument("--vlm_module", default=None, help="force a VLM module instead of config.json's model_type")
        p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
        p.add_argument("--port", type=int, default=9000)
        p.add_argument("--token", default=None, help="bearer token clients must send (env VLM_GRPO_SERVE_TOKEN)")
        p.add_argument(
            "--image_root",
            action="append",
            default=None,
            help="folder images may be read from; repeat for several (env VLM_GRPO_SERVE_IMAGE_ROOTS; default: cwd)",
        )
        p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
        p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float16, float32")
        p.add_argument("--concurrency", type=int, default=None, help="env INFERENCE_CONCURRENCY (default 1)")
        p.add_argument(
            "--acquire_timeout", type=float, default=None, help="env INFERENCE_ACQUIRE_TIMEOUT seconds (default 300)"
        )
        batch_env = "LISTENER_BATCH_SIZE" if role == "listener" else "SPEAKER_BATCH_SIZE"
        p.add_argument("--batch_size", type=int, default=None, help=f"images per model call (env {batch_env})")
        p.add_argument(
            "--max_body_bytes", type=int, default=None, help="request body limit, 413 above (default 16 MiB)"
        )
        p.add_argument(
            "--max_image_pixels",
            type=int,
            default=None,
            help="pixels of one image, read from its header before decoding; 413 above (default 16777216)",
        )
        p.add_argument("--max_data_uris", type=int, default=None, help="data: image URIs per request (default 16)")
        p.add_argument(
            "--max_data_uri_bytes", type=int, default=None, help="characters of one data: URI (default 4 MiB)"
        )
        p.add_argument("--min_pixels", type=int, default=None)
        p.add_argument("--max_pixels", type=int, default=None)
        p.add_argument("--max_anyres_num", type=int, default=None)
        p.add_argument("--trust_remote_code", action="store_true")
        p.add_argument("--log_level", default="info")
        if role == "speaker":
            p.add_argument("--max_new_tokens", type=int, default=128, help="default generation length")
    wait = sub.add_parser("wait", help="wait until a service's /health answers (bounded)")
    wait.add_argument("url", help="base URL, e.g. http://127.0.0.1:9000")
    wait.add_argument("--timeout", type=float, default=300.0)
    wait.add_argument("--interval", type=float, default=0.5)
    wait.add_argument("--pid", type=int, default=None, help="give up early if this process exits")
    return parser


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from vlm_grpo.modules import ImageLimits
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import ListenerScorer, SpeakerDescriber, load_vlm
    from vlm_grpo.serve.settings import ServeSettings

    settings = ServeSettings.from_env(
        args.role,
        concurrency=args.concurrency,
        acquire_timeout=args.acquire_timeout,
        batch_size=args.batch_size,
        token=args.token,
        image_roots=tuple(args.image_root or ()),
        max_body_bytes=args.max_body_bytes,
        max_image_pixels=args.max_image_pixels,
        max_data_uris=args.max_data_uris,
        max_data_uri_bytes=args.max_data_uri_bytes,
    )
    if not is_loopback_host(args.host) and not settings.token:
        logger.warning("Serving on %s without a token: anyone who can reach it can use the model", args.host)
    vlm = load_vlm(
        args.model,
        vlm_module=args.vlm_module,
        device=args.device,
        dtype=args.dtype,
        limits=ImageLimits(args.min_pixels, args.max_pixels, args.max_anyres_num),
        trust_remote_code=args.trust_remote_code,
    )
    if args.role == "listener":
        app = create_app(settings, listener=ListenerScorer(vlm, settings.batch_size))
    else:
        app = create_app(settings, speaker=SpeakerDescriber(vlm, settings.batch_size, args.max_new_tokens))
    logger.info(
        "%s service for %s on http://%s:%d (concurrency %d, acquire timeout %gs, batch size %d, image roots %s, "
        "token %s)",
        args.role,
        args.model,
        args.host,
        args.port,
        settings.concurrency,
        settings.acquire_timeout,
        settings.batch_size,
        ", ".join(settings.image_roots),
        "on" if settings.token else "off",
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role == "wait":
        logging.getLogger("httpx").setLevel(logging.WARNING)
        from vlm_grpo.serve.settings import ENV_TOKEN
        from vlm_grpo.serve.threaded import wait_for_health

        try:
            health = wait_for_health(
                args.url, timeout=args.timeout, interval=args.interval, token=os.environ.get(ENV_TOKEN), pid=args.pid
            )
        except (TimeoutError, RuntimeError) as exc:
            print(f"vlm-grpo-serve wait: {exc}", file=sys.stderr)
            sys.exit(1)
        print(f"{args.url} is up: {health}", flush=True)
        return
    _serve(args)


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
