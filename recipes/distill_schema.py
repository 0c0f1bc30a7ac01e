"""``recipes/distill.py``'s own keys (docs/distillation.md), declared once: the ``teacher`` and
``distill`` sections, and the config that is fine-tuning's with them and what distillation refuses
(``recipes/schema.py`` declares the rest).
"""

from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field

from recipes.schema import Config, Section, Text, key


class Teacher(Section):
    """``recipes/distill.py``'s frozen teacher (docs/distillation.md): a Hugging Face folder or
    Hub id, or a config built with seeded weights as ``model.config`` is; the student's
    vocabulary, split on the student's meshes by its own TP plan."""

    pretrained_path: Text | None = key(
        "null (built from teacher.config) or a local Hugging Face model folder or a Hub id",
        "the teacher's folder or Hub id (null: built from teacher.config)",
    )
    # the family teacher.config builds (its TP plan); null: llama, or a folder's own (config.json);
    # given beside a folder, it must be the folder's
    family: Text | None = key(
        "null (built: llama; a folder: its config.json's) or a model family, e.g. qwen3"
    )
    # the built teacher's config keys; null: the family's tiny size at twice the width and depth
    config: dict[str, Any] = key(
        "a mapping of Hugging Face config keys, e.g. teacher.config.hidden_size=256"
    )


class Distill(Section):
    """``recipes/distill.py``'s loss: alpha · CE + (1 − alpha) · T² · KL(teacher ‖ student)."""

    # the cross entropy's share of the loss; the KL term has the rest
    alpha: Annotated[float, Field(ge=0, le=1)] = key(
        "a number in [0, 1], e.g. distill.alpha=0.5", "the cross entropy's share of the loss"
    )
    # T: both models' softmaxes are taken of their logits / T in the KL
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False)] = key(
        "a positive number, e.g. distill.temperature=2.0", "the KL's softmax temperature T"
    )


class DistillConfig(Config):
    """``recipes/distill.py``'s config: every key of ``finetune.py``'s, the ``teacher`` and the
    ``distill`` sections."""

    RECIPE: ClassVar[str] = "recipes/distill.py"
    experts_beside: ClassVar[bool] = True  # an MoE teacher's experts split at ep > 1
    DEGREES_AT_ONE: ClassVar[dict[str, str]] = {
        "pp": "the teacher has no pipeline stages of its own: use pp=1",
    }

    teacher: Teacher
    distill: Distill

    def model_folders(self) -> dict[str, str | None]:
        """Fine-tuning's, and the teacher's."""
        return super().model_folders() | {"teacher.pretrained_path": self.teacher.pretrained_path}

    def option_problems(self, warmup: int, output: Path, device_type: str) -> tuple[list, Any]:
        """Fine-tuning's, and the degrees ``distill.py`` does not run."""
        found, fault = super().option_problems(warmup, output, device_type)
        return found + self.degree_problems(), fault
