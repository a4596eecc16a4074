"""`train.teacher: ema`: the teacher is an exponential moving average of the student.

After every optimiser step each teacher weight moves `train.teacher_ema_rate` of the way to the
student's: θ_T ← (1 − r) θ_T + r θ_S. It starts equal to the student (after a warm start), so
step 1's teacher is the starting student and a small rate keeps it close to it.

Where the teacher's weights live:
    a full student   a frozen copy of the backbone (`Trainer.teacher`), every base weight averaged;
    a LoRA student   a frozen third adapter "teacher" on the same backbone, a copy of the student
                     adapter whose A and B factors are averaged separately (the average of the
                     factors, not of their product B·A: what keeps it an adapter).

The averaged weights are part of the checkpoint (state.pt), so a resumed run's teacher is the one
the killed run had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lopd_cli.errors import LopdError
from lopd_cli.models import adapters as ad

TEACHER = "teacher"  # the LoRA student's EMA adapter


@dataclass
class EmaTeacher:
    pairs: list[tuple[torch.Tensor, torch.Tensor]]  # (teacher weight, student weight), same shapes
    rate: float

    @torch.no_grad()
    def update(self) -> None:
        for t, s in self.pairs:
            t.lerp_(s.detach().to(t.dtype), self.rate)

    @torch.no_grad()
    def reset(self) -> None:
        """The teacher becomes the student as it is now (a run's start, after a warm start)."""
        for t, s in self.pairs:
            t.copy_(s.detach())

    def state_dict(self) -> list[torch.Tensor]:
        return [t.detach().cpu().clone() for t, _ in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.pairs):
            raise LopdError(f"EMA teacher: the checkpoint holds {len(tensors)} weights, this run {len(self.pairs)}")
        for (t, _), saved in zip(self.pairs, tensors):
            t.copy_(saved)


def add_teacher_adapter(model, lora_cfg) -> None:
    """A LoRA student's EMA teacher: a frozen adapter beside "student" (call before set_trainable)."""
    model.add_adapter(TEACHER, ad.peft_lora_config(lora_cfg))
    for p in ad.adapter_parameters(model, TEACHER):
        p.requires_grad_(False)


def lora_pairs(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    student = {n.replace(f".{ad.STUDENT}.", f".{TEACHER}."): p
               for n, p in model.named_parameters() if ad.adapter_of(n) == ad.STUDENT}
    teacher = [(n, p) for n, p in model.named_parameters() if ad.adapter_of(n) == TEACHER]
    if len(teacher) != len(student) or any(n not in student for n, _ in teacher):
        raise LopdError("EMA teacher: the teacher adapter does not mirror the student adapter")
    return [(p, student[n]) for n, p in teacher]


def full_pairs(teacher_model, student_model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A full student's base weights against its frozen teacher copy's, by name."""
    base = student_model.get_base_model() if ad.is_wrapped(student_model) else student_model
    student = {n.replace(".base_layer.", "."): p for n, p in base.named_parameters() if ad.adapter_of(n) == ad.BASE}
    pairs = []
    for n, p in teacher_model.named_parameters():
        if n not in student:
            raise LopdError(f"EMA teacher: the student has no weight {n}")
        pairs.append((p, student[n]))
    return pairs


def teacher_view(model):
    """The view the teacher pass runs a LoRA student's model under: the "teacher" adapter."""
    return ad.use_encoder(model, TEACHER)
