"""One rank of a ``DataServerTrainer`` run under torchrun (CPU, gloo), for
``tests/test_transformers.py``: trains a tiny RT-DETR from the pool at ``--train``, writes
the dataset indices of every training batch it got to ``--record`` (one JSON list a line),
checkpoints every ``--save-steps``, stops after ``--stop-after`` steps (0: runs through),
resumes from the last checkpoint with ``--resume``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import TrainerCallback, TrainingArguments

from dataserver_client.integrations.transformers import DataServerTrainer


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.step and state.global_step == self.step:
            control.should_training_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    from test_transformers import processor, tiny_model

    training = TrainingArguments(
        output_dir=args.output,
        per_device_train_batch_size=2,
        num_train_epochs=args.epochs,
        save_strategy="steps",
        save_steps=args.save_steps,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=5,
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = DataServerTrainer(
        model=tiny_model(),
        args=training,
        train=args.train,
        image_processor=processor(),
        client_kwargs={"timeout": 30.0},
        callbacks=[StopAt(args.stop_after)],
    )
    loader = trainer.get_train_dataloader()
    prepare = loader.prepare
    rank = training.process_index
    record = open(f"{args.record}.rank{rank}", "a")

    def wrapped(batch: Any) -> dict[str, Any]:
        record.write(json.dumps([i[0] for i in batch.indices]) + "\n")
        record.flush()
        return prepare(batch)

    loader.prepare = wrapped
    try:
        trainer.train(resume_from_checkpoint=True if args.resume else None)
    finally:
        trainer.close()
        record.close()


if __name__ == "__main__":
    main()
