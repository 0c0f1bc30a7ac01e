"""``recipes/dpo.py``'s own keys (docs/dpo.md), declared once: the ``dpo`` section (the loss),
and the config that is fine-tuning's with it and what DPO refuses (``recipes/schema.py`` declares
the rest).
"""

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from components.problems import Problem, problems, show
from components.training.options import DPO_LOSS_TYPES
from recipes.schema import Config, Section, Text, key, one_of, refused_settings


class Dpo(Section):
    """``recipes/dpo.py``'s loss (docs/dpo.md): a policy against a frozen reference on preference
    pairs."""

    # the loss's sharpness: rewards are beta × (policy − reference) answer log-probabilities
    beta: Annotated[float, Field(gt=0, allow_inf_nan=False)] = key(
        "a positive number, e.g. dpo.beta=0.1", "DPO's beta: rewards are beta × log-prob ratios"
    )
    # sigmoid: DPO's −log σ(β·Δ); ipo: (Δ per answer token − 1/(2β))²
    loss_type: Literal[DPO_LOSS_TYPES] = key(one_of(DPO_LOSS_TYPES), "sigmoid (DPO) or ipo")
    # conservative DPO (sigmoid only): the assumed probability that a pair's labels are flipped
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = key(
        "a number in [0, 0.5), e.g. dpo.label_smoothing=0.1"
    )

    # the frozen reference: null, the policy's starting weights; or a folder of its architecture
    reference_path: Text | None = key(
        "null (the policy's starting weights) or a local Hugging Face model folder of the "
        "policy's architecture and vocabulary",
        "the frozen reference's folder (null: the policy's starting weights)",
    )

    def errors(self) -> list[str]:
        """Settings that do not go together."""
        if self.loss_type == "ipo" and self.label_smoothing:
            return [
                f"dpo.label_smoothing={show(self.label_smoothing)} applies to "
                "dpo.loss_type=sigmoid only: use dpo.label_smoothing=0.0 with ipo"
            ]
        return []


class DpoConfig(Config):
    """``recipes/dpo.py``'s config: every key of ``finetune.py``'s and the ``dpo`` section."""

    RECIPE: ClassVar[str] = "recipes/dpo.py"
    DEGREES_AT_ONE: ClassVar[dict[str, str]] = {
        "cp": "an answer's log-probability sums its whole sequence, which context parallelism "
        "splits: use cp=1",
        "pp": "no pipeline schedule runs DPO's two forwards: use pp=1",
    }
    preference_pairs: ClassVar[bool] = True
    dpo: Dpo

    def option_problems(self, warmup: int, output: Path, device_type: str) -> tuple[list, Any]:
        """Fine-tuning's, the ``dpo`` section's, and what ``dpo.py`` does not run."""
        found, fault = super().option_problems(warmup, output, device_type)
        return found + problems("dpo", self.dpo.errors()) + self.unsupported(), fault

    def model_errors(self, model_type: str, experts: tuple[str, ...]) -> list[str]:
        """A model whose head the chunked log-probabilities do not compute."""
        from components.distributed.chunked_loss import PLAIN_HEAD_FAMILIES  # torch

        if model_type in PLAIN_HEAD_FAMILIES:
            return []
        return [
            f"model={self.model.name} is a {model_type} model: dpo.py computes the answers' "
            f"log-probabilities from the plain lm_head of {', '.join(PLAIN_HEAD_FAMILIES)} models: "
            "use one of those"
        ]

    def model_folders(self) -> dict[str, str | None]:
        """Fine-tuning's, and the reference's."""
        return super().model_folders() | {"dpo.reference_path": self.dpo.reference_path}

    def unsupported(self) -> list[Problem]:
        """The settings ``dpo.py`` refuses, each one problem naming its key (docs/dpo.md)."""
        train, peft, loss_on = self.train, self.peft, self.data.loss_on
        refused = [  # (key, its value, refused, why)
            ("data.loss_on", loss_on, loss_on != "last_assistant", "it scores each pair's final "
             "answer alone (earlier assistant turns are prompt, conf/dpo_over_groups.yaml): "
             "leave data.loss_on out, or use data.loss_on=last_assistant"),
            ("train.packing", train.packing, train.packing, "a preference pair's two "
             "conversations are rows of their own: use train.packing=false"),
            ("peft.experts", peft.experts, bool(peft.experts), "adapters on experts cannot be "
             "switched off for the reference: use peft.experts=false"),
            ("moe.routing_bias_rate", self.moe.routing_bias_rate, self.moe.routing_bias_rate > 0
             and peft.name != "none" and self.dpo.reference_path is None, f"with peft={peft.name} "
             "the reference is the policy with its adapters off, whose routers' bias moves with "
             "training: give dpo.reference_path=FOLDER (the starting weights), or leave the rate "
             "at 0"),
        ]  # fmt: skip
        return self.degree_problems() + refused_settings(self.RECIPE, refused)
