"""Serve a registered VLM over HTTP so other runs can use it as a reward model.

Two roles, one command each (``vlm-grpo-serve`` or ``python -m vlm_grpo.serve``)::

    vlm-grpo-serve listener --model PATH --host 127.0.0.1 --port 9000 --image_root /data/images
    vlm-grpo-serve speaker  --model PATH --port 9001 --image_root /data/images

* listener: ``POST /score``, ``POST /batch_score`` -- the probability of "yes" for each candidate image
  under a question (see :mod:`vlm_grpo.serve.listener` for the exact rule);
* speaker: ``POST /describe``, ``POST /batch_describe`` -- a generated description with its
  ``<thinking>`` / ``<coarse>`` / ``<detailed>`` fields parsed out;
* both: ``GET /health`` -- role, model, device, queue depth.

The app itself is built by :func:`vlm_grpo.serve.app.create_app`, so it can also be mounted or run in a
thread (:class:`vlm_grpo.serve.threaded.ThreadedServer`). FastAPI and uvicorn are the ``serve`` extra.
"""

from __future__ import annotations

from vlm_grpo.serve.settings import ServeSettings

__all__ = ["ServeSettings"]
