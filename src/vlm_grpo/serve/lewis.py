"""``python -m vlm_grpo.serve.lewis``: the Lewis game builder's command line, the same as
``python -m vlm_grpo.data.lewis`` (the builders are in :mod:`vlm_grpo.data.lewis`); run scripts may call either."""

from vlm_grpo.data.lewis import main

if __name__ == "__main__":
    main()
