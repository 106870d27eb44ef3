"""`fz.hf.Trainer`: Hugging Face's Trainer, training on fz.

    from fz.hf import Trainer, TrainingArguments    # instead of: from transformers import ...
    args = TrainingArguments("out", deepspeed="ds_config.json", per_device_train_batch_size=8, ...)
    Trainer(model=model, args=args, train_dataset=ds, eval_dataset=ev).train()

The ZeRO setup comes from `args.deepspeed` (a JSON path or dict, its "auto" values filled
from the arguments as transformers fills them) or from `spec=fz.Spec(...)`; with neither,
stage 0. Everything else is transformers' own Trainer: the arguments, the callbacks and
their control flow (logging, evaluation and save steps), the log history, TensorBoard,
`evaluate` and `predict` with `compute_metrics`. What fz replaces is the inner loop: the
model's parameters and the optimizer live in an fz State (`trainer.fz_state`), each update
is one `fz.train_step` over the step's micro-batches, and evaluation runs `fz.apply`.

- Data: the micro-batches transformers' Trainer reads, in its order (fz/hf/data.py), each
  collated on its own (padding collators, BatchEncoding), kept in the State: a resumed run
  continues at the exact next sample, at any world size. An epoch's last step is trained.
  Random masks and dropout draw from the process's generator where transformers' draw
  (fz/hf/draws.py), saved with each checkpoint and set on resuming as transformers sets it.
- Loss: `compute_loss` (a subclass's override too) on each micro-batch, with transformers'
  `num_items_in_batch` (the label tokens of all the step's micro-batches on all ranks, summed
  with `fz.sum_over_ranks`) and transformers' scaling; fz adds the micro-batches
  (Spec.accumulate="sum") and averages the ranks, as DDP and DeepSpeed under the Trainer do.
  The logged loss is transformers' account of it (per micro-batch, NaN-filtered, rank-averaged),
  and evaluation takes `compute_loss` as transformers' prediction_step does (fz/hf/evaluation.py).
- Checkpoints: `checkpoint-N/` holds fz's checkpoint (`fz/`), the trainer state, config and tokenizer,
  written as `tmp-checkpoint-N/`, renamed last (fz/hf/checkpoint_dirs.py); save_model() as transformers'.
- While train() runs `trainer.model`'s trainable weights are the State's (views of its compute
  copy at ZeRO 0-2, meta at ZeRO-3); after it, the trained ones (fz/hf/model_weights.py).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, cast

import torch
import transformers
from torch import nn
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import SaveStrategy, TrainOutput, speed_metrics

import fz
from fz.errors import ConfigError
from fz.hf import checkpoint_dirs as dirs
from fz.hf import collective_calls, counts, data, draws, model_calls, model_weights, online, trainer_checkpoints
from fz.hf.arguments import refuse_trainer_settings, spec_from_args
from fz.hf.client_optimizers import chosen_optimizer, given_optimizer
from fz.hf.evaluation import Evaluated, prediction, prepared
from fz.hf.export import save_pretrained
from fz.hf.replaced import loss_context, warn_not_called
from fz.hf.second_models import shard_second_models
from fz.hf.step_inputs import RecordedStep, preparing_step
from fz.hf.training_args import TrainingArguments, as_fz_arguments
from fz.hf.views import TrainerOptimizer, logged_lr, next_lr, schedule_view

log = logging.getLogger(__name__)
FZ_DIR = dirs.FZ_DIR


class Trainer(RecordedStep, transformers.Trainer):
    """transformers.Trainer on fz; `spec=` an fz.Spec instead of `args.deepspeed`."""

    def __init__(self, *args: Any, spec: fz.Spec | None = None, **kwargs: Any):
        given = args[1] if len(args) > 1 else kwargs.get("args")
        if given is not None:
            converted = as_fz_arguments(given)
            if len(args) > 1:
                args = (args[0], converted, *args[2:])
            else:
                kwargs["args"] = converted
        elif "model_init" not in kwargs:
            kwargs["args"] = TrainingArguments(output_dir="trainer_output")
        super().__init__(*args, **kwargs)
        self.fz_spec = spec
        self.fz_state: fz.State | None = None
        self._refuse(kwargs)
        warn_not_called(self, Trainer)
        self._loader: Any = None
        self._micro_rows: int | None = None  # rows of a training micro-batch (None: per_device_train_batch_size)
        self._fz_released: model_weights.Released = {}  # trainer.model's parameters let go while training
        self._items: Any = None  # the step's num_items_in_batch (None: a per-micro-batch mean)
        self._micro_count = 1  # the step's micro-batches
        self._micro_losses: list[torch.Tensor] = []  # the step's micro-batches' losses on this rank
        model_calls.not_placed(self)  # nor a reference model or teacher TRL prepares next: a first call places it

    # ---------------------------------------------------------------- setup
    def _refuse(self, kwargs: dict[str, Any]) -> None:
        """Trainer features fz does not run, named at construction (never a silent fallback)."""
        refuse_trainer_settings(self.args, self._model(), spec=self.fz_spec, model_init=self.model_init,
                                kwargs=kwargs)
        self._fz_given = given_optimizer(self, kwargs)  # optimizers=(...), checked now

    def _max_steps(self) -> tuple[int, int | None]:
        """(optimizer steps to train, steps per epoch) as transformers counts them from the
        arguments, with fz's full steps (micro batch x accumulation x ranks)."""
        args = self.args
        per_epoch = data.steps_per_epoch(args, *self._reads(self.train_dataset)[:2]) \
            if self.train_dataset is not None else None
        if args.max_steps > 0:
            return args.max_steps, per_epoch
        if self.train_dataset is None:  # evaluate() or predict() only: the schedule is never used
            return 1, None
        if not per_epoch:
            raise ConfigError("fz.hf.Trainer: set max_steps (the training set has no length, or, with "
                              "dataloader_drop_last, fewer samples than one micro-batch on each of the "
                              f"{max(1, args.world_size)} ranks)")
        return math.ceil(args.num_train_epochs * per_epoch), per_epoch

    def _loss(self, model: Any, batch: Any) -> torch.Tensor:
        """transformers' training_step on one micro-batch, but for its backward: compute_loss with
        the step's `num_items_in_batch`, and the division by the step's micro-batches where the
        loss is a per-micro-batch mean (fz adds the micro-batches: Spec.accumulate="sum")."""
        with model_calls.in_step(model), loss_context(self):  # trainer.model inside: this forward
            loss = cast(torch.Tensor, self.compute_loss(model, batch, num_items_in_batch=self._items))
        if self.args.n_gpu > 1:
            loss = loss.mean()
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and self._items is not None) or self.compute_loss_func is not None
        loss = loss if scaled else loss / self._micro_count
        self._micro_losses.append(loss.detach())  # transformers' tr_loss_step
        return loss

    def _before_step(self, batches: fz.MicroBatches) -> None:
        """What transformers' loop counts of a step before its forwards (fz/hf/counts.py)."""
        self._items, self._micro_count, self._micro_losses = counts.num_items(self, batches), len(batches), []
        self.current_gradient_accumulation_steps = len(batches)
        model_calls.follow_hooks(self)  # one a callback added in on_train_begin
        data.tell_accelerate(self, self._loader.ends_epoch)  # gather_for_metrics drops the samples filled in
        flos = float(self.current_flos) + sum(float(self.floating_point_ops(mb)) for mb in batches)
        self.current_flos = flos  # type: ignore[assignment]  # transformers declares it int, adds floats
        counts.track_input_tokens(self, batches)

    def store_flos(self) -> None:
        """transformers' store_flos, the ranks' flos summed by fz (bounded) rather than by a raw gather."""
        flos = float(self.current_flos)
        if self.fz_state is not None and self.args.world_size > 1:
            flos = float(fz.sum_over_ranks(self.fz_state, flos))
        self.state.total_flos += flos
        self.current_flos = 0

    def fz_ready(self) -> fz.State:
        """The State, made on first use (before training too: evaluate() may come first)."""
        if self.fz_state is None:
            model = self._model()
            self._fz_released = model_weights.upcast(model) | self._fz_released  # bf16 ones: fp32 masters
            steps = self._max_steps()[0]
            spec = spec_from_args(self.args, model, max_steps=steps, spec=self.fz_spec, chosen=chosen_optimizer(
                self, model, steps), decay_names=self.get_decay_parameter_names(model))
            self._one_checkpointing(spec)
            if spec.clip_grad_norm is None:  # max_grad_norm=0: transformers logs the norm all the same
                spec = spec.replace(clip_grad_norm=math.inf)
            self.fz_state = fz.init(model, spec.replace(loss_fn=self._loss, accumulate="sum"))
            shard_second_models(self, model, self.fz_state.spec)  # TRL's ref_model, ...: inference-only States
        return self.fz_state

    def _one_checkpointing(self, spec: fz.Spec) -> None:
        """fz checkpoints the blocks itself when the Spec says so (gradient_checkpointing=True): transformers'
        own, which Trainer.train() switches on, would recompute each block a second time inside fz's."""
        model = self._model()
        if spec.activation_checkpointing and getattr(model, "is_gradient_checkpointing", False):
            cast(Any, model).gradient_checkpointing_disable()

    def _model(self) -> nn.Module:
        if self.model is None:
            raise ConfigError("fz.hf.Trainer needs model=")
        return self.model

    def _reads(self, dataset: Any) -> tuple[Any, int | None, Any]:
        """(what fz.data reads, rows of a micro-batch, order): an online trainer's own (fz/hf/online.py)."""
        return online.reads(self, dataset) if online.online_class(self) is not None else (dataset, None, None)

    def _train_loader(self) -> Any:
        dataset = self.train_dataset
        if dataset is None:
            raise ConfigError("fz.hf.Trainer.train() needs a train_dataset")
        if dataset.__class__.__module__.startswith("datasets"):
            dataset = self._remove_unused_columns(dataset, description="training")
        collate = self._get_collator_with_removed_columns(self.data_collator, description="training")
        dataset, self._micro_rows, order = self._reads(dataset)
        order = order or data.length_grouped(self, dataset)  # group_by_length: its lengths read once, here
        return draws.reading(self.args, dataset, self.fz_ready(), collate, micro=self._micro_rows, order=order)

    # ---------------------------------------------------------------- the loop
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing here: the loop restores fz's checkpoint (weights, optimizer, data position) itself."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Nothing either (called after fz's restore: a subclass's own additions load)."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """transformers' train(); `resume_from_checkpoint` (True: the last complete one) checked first."""
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            resume_from_checkpoint = dirs.to_resume(resume_from_checkpoint, str(self.args.output_dir))
            trainer_checkpoints.trainer_state(resume_from_checkpoint)  # checked before transformers reads it
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        except BaseException:  # Ctrl-C too: the model is not left without its weights where they can come back
            if self._fz_released:
                model_weights.fill_after_error(self._copy_weights_into_model)
            raise
        finally:  # transformers' _finalize_training takes NEFTune's hook off; fz's loop does not run it
            model_calls.end_neftune(self)
            data.tell_accelerate(self, None)  # its training dataloader is done

    def _inner_training_loop(self, batch_size: int | None = None, args: Any = None,
                             resume_from_checkpoint: str | None = None, trial: Any = None,
                             ignore_keys_for_eval: list[str] | None = None) -> TrainOutput:
        args = self.args
        max_steps, per_epoch = self._max_steps()
        epochs = math.ceil(max_steps / per_epoch) if per_epoch else args.num_train_epochs
        every = [*self.callback_handler.callbacks, self.control]
        stateful: Any = [cb for cb in every if isinstance(cb, ExportableState)]
        self.state = TrainerState(stateful_callbacks=stateful)
        self.state.train_batch_size = self._train_batch_size
        self.state.compute_steps(args, max_steps)
        state = self.fz_ready()
        self._one_checkpointing(state.spec)
        resumed_rng = None  # the generator saved with the checkpoint, set as transformers sets it on resuming
        if resume_from_checkpoint is not None:
            state, resumed_rng = trainer_checkpoints.resume(self, state, resume_from_checkpoint)
        elif int(state.step):  # train() again: transformers keeps the optimizer, makes a new schedule, reads anew
            unread = {k: v for k, v in state.data.items() if k != "loader"} if isinstance(state.data, dict) else {}
            state = state.replace(step=torch.zeros_like(state.step), data=unread,
                                  opt_state=fz.optim.restart_schedule(state.opt_state))
        self.state.init_training_references(self, max_steps, epochs, trial)
        self.fz_state = state
        self._let_go_of_weights()  # the State holds them (fz/hf/model_weights.py)
        self._loader = self._train_loader()
        if resumed_rng is not None and self._loader.at_epoch_start:  # before the epoch's reads, as transformers
            resumed_rng()
            resumed_rng = None
        self.callback_handler.model, self.callback_handler.train_dataloader = self.model, self._loader
        self.optimizer = self.callback_handler.optimizer = TrainerOptimizer(self._next_lr)  # type: ignore[assignment]
        self.lr_scheduler = self.callback_handler.lr_scheduler = schedule_view(  # type: ignore[assignment]
            state, self._next_lr, lambda: self.state.global_step)
        start, first = time.time(), self.state.global_step
        self._fz_running, self._fz_total, self._fz_logged_at = 0.0, 0.0, first  # transformers' loss accounting
        (log.info if self.is_world_process_zero() else log.debug)(  # once, as transformers' replicas log less
            "fz.hf.Trainer: %d steps of %d samples (%d per device x %d accumulation x %d ranks), %s; %s", max_steps,
            self._samples_per_step(), args.per_device_train_batch_size, args.gradient_accumulation_steps,
            args.world_size, state.spec.explain().splitlines()[0], fz.memory_report(state).summary())
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if getattr(args, "eval_on_start", False):
            self.evaluate(ignore_keys=ignore_keys_for_eval)
        size = len(self._loader.dataset) if hasattr(self._loader.dataset, "__len__") else None
        open_epoch = False
        reading = iter(self._loader)
        while self.state.global_step < max_steps and not self.control.should_training_stop:
            batches = next(reading, None)  # asked for only when trained on (its reading collates ahead)
            if batches is None:
                break
            if not open_epoch:
                open_epoch = True
                self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            self._model().train()  # as transformers' training_step (an evaluation put it in eval mode)
            if resumed_rng is not None:  # mid-epoch: after the first step's batches are read, as transformers
                resumed_rng()
                resumed_rng = None
            self._before_step(batches)
            generating = online.train_step if online.online_class(self) is not None else preparing_step(self)
            if generating is not None:  # TRL's GRPO, RLOO (generated, scored), GKD (generated): then trained
                self.fz_state = generating(self, batches)
            else:
                self.fz_state, _ = draws.train_step(self.fz_state, batches)
            model_weights.follow(self._model(), self.fz_state, self._fz_released, self.callback_handler.callbacks)
            self._add_losses()
            # transformers' hooks in its order; fz's update is one call, so they come after it
            for _ in range(len(batches) - 1):
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
            self.state.global_step += 1
            self.state.epoch = data.epoch_progress(args, self._loader.state_dict(), size, max_steps, self._micro_rows)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._log_save_evaluate(trial, ignore_keys_for_eval)
            stop_epoch = self.control.should_epoch_stop and not self._loader.ends_epoch
            if self._loader.ends_epoch or stop_epoch:  # before the next epoch's reads, as transformers ends one
                open_epoch = False
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                self._log_save_evaluate(trial, ignore_keys_for_eval)
            if (stop_epoch or self._loader.ends_epoch) and per_epoch and self._loader.epoch + 1 >= epochs:
                break  # the last epoch ended (by a callback, before max_steps too), as transformers' epoch loop
            if stop_epoch:  # a callback ended the epoch: the next one from its start
                reading.close()
                self._loader.seek(self._loader.epoch + 1)
                reading = iter(self._loader)
        if open_epoch:  # stopped within an epoch: transformers ends it all the same
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._log_save_evaluate(trial, ignore_keys_for_eval)
        steps = self.state.global_step - first
        metrics = speed_metrics("train", start, num_samples=steps * self._samples_per_step(), num_steps=steps)
        metrics["train_loss"] = (self._fz_total + self._fz_running) / max(steps, 0.001)  # the rest: this rank's
        self.store_flos()
        metrics["total_flos"] = self.state.total_flos
        self._memory_tracker.stop_and_update_metrics(metrics)  # skip_memory_metrics=False: train_mem_*
        self.log(metrics)
        self.fz_state = trainer_checkpoints.end_with_the_best(self, trial)  # load_best_model_at_end, save_total_limit
        self._copy_weights_into_model()
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        self.is_in_train = False
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _next_lr(self) -> float:
        return next_lr(self.fz_ready())

    def _add_losses(self) -> None:
        """The step's micro-batch losses added to this rank's running loss as transformers adds them: a
        NaN or inf one (a skipped step) as the mean since the last log (logging_nan_inf_filter)."""
        for value in (float(v) for v in self._micro_losses):
            if self.args.logging_nan_inf_filter and not math.isfinite(value):
                self._fz_running += self._fz_running / (1 + self.state.global_step - self._fz_logged_at)
            else:
                self._fz_running += value

    def _samples_per_step(self) -> int:
        a = self.args
        return a.per_device_train_batch_size * a.gradient_accumulation_steps * max(1, a.world_size)

    def _log_save_evaluate(self, trial: Any, ignore_keys: list[str] | None) -> None:
        """transformers' _maybe_log_save_evaluate: the loss since the last log averaged over ranks
        (summed by fz, bounded), the evaluation and its best metric, the checkpoint."""
        if self.control.should_log and self.state.global_step > self._fz_logged_at:
            assert self.fz_state is not None
            metrics, tr = self.fz_state.metrics, self._fz_running
            if self.args.world_size > 1:
                tr = float(fz.sum_over_ranks(self.fz_state, tr)) / self.args.world_size
            logs = {"loss": tr / (self.state.global_step - self._fz_logged_at)}
            if not math.isnan(norm := float(metrics.get("grad_norm", math.nan))):
                logs["grad_norm"] = norm
            if (lr := logged_lr(self.fz_state)) is not None:  # DeepSpeed's sections: the next one, as there
                logs["learning_rate"] = lr
            self._fz_running, self._fz_total, self._fz_logged_at = 0.0, self._fz_total + tr, self.state.global_step
            self.store_flos()
            self.log(logs)
        if self.control.should_evaluate:  # as transformers: the best metric (EarlyStoppingCallback, "best" saves)
            metrics = self._evaluate(trial, ignore_keys)
            best = self._determine_best_metric(metrics=metrics, trial=trial)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = best
        if self.control.should_save:
            self._save_checkpoint(None, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    # ---------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """`checkpoint-N/` (fz/hf/trainer_checkpoints.py): fz's checkpoint of the State with the data
        position, the trainer state, config, tokenizer and arguments, written as `tmp-checkpoint-N/`
        and renamed when complete; older ones rotated out as save_total_limit says."""
        trainer_checkpoints.save_checkpoint(self, trial)

    # ---------------------------------------------------------------- evaluation and the model
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return Evaluated(self)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) of one batch: `compute_loss` as transformers calls it, its forward
        `fz.apply` on the State (every rank takes part)."""
        return prediction(self, model, inputs, prediction_loss_only, ignore_keys)

    def _copy_weights_into_model(self) -> None:
        """The State's weights in `self.model` (in the dtype transformers' holds): after train(), to generate."""
        if self.fz_state is not None:
            model_weights.fill(self._model(), self.fz_state, self._fz_released, trainer_checkpoints.module_dtype(self))
            model_calls.uninstall(self._model())
            self._fz_released = {}

    def _let_go_of_weights(self) -> None:
        """`self.model`'s weights freed while train() runs: the State holds them."""
        state = self.fz_ready()
        placed = state.spec.stage < 3 or online.online_class(self) is not None  # it fits, or generates
        let_go = model_weights.let_go(self._model(), self.args.device if placed else None, state)
        self._fz_released = let_go | self._fz_released  # a parameter let go before keeps its first record (its dtype)
        model_calls.install(self, self._model())

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        collective_calls.check_in(prepared(self, "evaluate"), "evaluate")
        with online.weights_held(self):  # an online trainer's evaluation generates with trainer.model
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        collective_calls.check_in(prepared(self, "predict"), "predict")
        return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """What transformers' save_model writes (a `from_pretrained` folder, or a PEFT adapter, in its
        dtype: trainer_checkpoints.saved_dtype), gathered one bucket at a time. Every rank calls it."""
        if self.fz_state is None:
            return super().save_model(output_dir, _internal_call)
        collective_calls.check_in(prepared(self, "save_model"), "save_model")
        out = output_dir or str(self.args.output_dir)
        save_pretrained(self.fz_state, out, model=self._model(), processing_class=trainer_checkpoints.tokenizer(self),
                        dtype=trainer_checkpoints.saved_dtype(self))
        if self.args.should_save:
            trainer_checkpoints.save_args(self.args, out)
