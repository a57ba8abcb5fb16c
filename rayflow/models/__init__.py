from rayflow.models.base import (
    DiffusionModel,
    PromptEmbeds,
    Schedule,
    load_configured,
    load_model,
    model_class,
    pipeline_class_of,
    register_model,
    registered_pipeline_classes,
)

__all__ = [
    "DiffusionModel",
    "PromptEmbeds",
    "Schedule",
    "load_configured",
    "load_model",
    "model_class",
    "pipeline_class_of",
    "register_model",
    "registered_pipeline_classes",
]
