"""DeepSpeed's engine API over fz: `import fz.deepspeed as deepspeed` runs a DeepSpeed script.

    model_engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(args=args, model=model,
        model_parameters=model.parameters(), training_data=data)
    for step, batch in enumerate(dataloader):
        loss = model_engine(batch); model_engine.backward(loss); model_engine.step()
    model_engine.save_checkpoint(save_dir, client_state={"step": step})
    _, client_state = model_engine.load_checkpoint(save_dir)

A thin shell: the engine holds an fz.State (`engine.state`) and runs fz.train_step's phases;
its checkpoints are fz checkpoints (and DeepSpeed's own are imported on load).
"""
from fz.deepspeed import accelerator, checkpointing, comm, ops, utils, zero
from fz.deepspeed.engine import DeepSpeedEngine
from fz.deepspeed.initialize import add_config_arguments, init_distributed, initialize
from fz.deepspeed.version import __version__

__all__ = ["DeepSpeedEngine", "__version__", "accelerator", "add_config_arguments", "checkpointing", "comm",
           "init_distributed", "initialize", "ops", "utils", "zero"]
