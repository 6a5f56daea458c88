"""vlm-grpo: GRPO-family RL for vision-language models, as a thin layer over TRL."""

__version__ = "0.1.0"

import os as _os
import sys as _sys

# ``python -m vlm_grpo.<recipe>`` puts the working directory first on sys.path, where a user's ``math.py`` (EasyR1's
# reward file name) would shadow the standard library. Moved last: stdlib and site packages win, local modules
# (``--reward_funcs my_rewards:fn``) still import.
if _sys.argv[:1] == ["-m"] and _sys.path and _sys.path[0] in ("", _os.getcwd()):
    _sys.path.append(_sys.path.pop(0))
