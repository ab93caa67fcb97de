"""The recipe: schema (one pydantic model per section), loading with positions, the reference."""

from dflash_trt.recipe.load import load_recipe, parse_yaml, validate_recipe
from dflash_trt.recipe.schema import (
    BUILTIN_DATA,
    BUILTIN_PROMPTS,
    Calibration,
    DrafterInit,
    DrafterSection,
    DrafterTrain,
    EngineSection,
    ModelQuant,
    QuantizeSection,
    Recipe,
    TargetSection,
    TritonSection,
    VerifySection,
    recipe_json_schema,
)

__all__ = [
    "BUILTIN_DATA", "BUILTIN_PROMPTS", "Calibration", "DrafterInit", "DrafterSection",
    "DrafterTrain", "EngineSection", "ModelQuant", "QuantizeSection", "Recipe", "TargetSection",
    "TritonSection", "VerifySection", "load_recipe", "parse_yaml", "recipe_json_schema",
    "validate_recipe",
]
