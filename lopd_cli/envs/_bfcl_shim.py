"""A stand-in for `bfcl_eval.constants.model_config`, which imports every vendor SDK.

The official AST checker reads one thing from it: whether a model's tool names had "." turned
into "_" (`MODEL_CONFIG_MAPPING[name].underscore_to_dot`). Our tools are OpenAI-style names,
so every name maps to a config saying yes. Call `install()` before importing bfcl_eval's
checkers; it leaves an already imported real module alone.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass


@dataclass
class StandInModelConfig:
    model_name: str = "lopd"
    display_name: str = "lopd"
    underscore_to_dot: bool = True  # our tool names replace "." with "_", like OpenAI's
    is_fc_model: bool = True
    url: str = ""
    org: str = ""
    license: str = ""
    model_handler: object = None
    input_price: float | None = None
    output_price: float | None = None


class _AnyModel(dict):
    def __missing__(self, key: str) -> StandInModelConfig:
        return StandInModelConfig(model_name=key, display_name=key)


MODULE = "bfcl_eval.constants.model_config"


def install() -> None:
    if MODULE in sys.modules:
        return
    module = types.ModuleType(MODULE, __doc__)
    module.ModelConfig = StandInModelConfig  # type: ignore[attr-defined]
    module.MODEL_CONFIG_MAPPING = _AnyModel()  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
