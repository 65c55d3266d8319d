// `make tango`'s experiment (tools/tango/run.py runs it): the same small model trained by 2 CPU
// workers with Tango's torch (DDP) engine, Tango's "fairscale" engine (through the fairscale alias)
// and fairscale_c's "fairscale_c" engine, in fp32 and with bf16 autocast. The FSDP runs wrap each
// block in an inner FSDP instance with activation checkpointing. 12 steps; validation and a
// checkpoint every 4 steps. Components: tools/tango/components.py (include it with -i).
//
// Steps: data, and <engine>_<precision> for engine in torch, fairscale, fairscale_c and
// precision in fp32, bf16 (bf16 autocast; FSDP's mixed_precision off for Tango's engine, on for
// ours, which then computes in bf16), plus fairscale_bf16_mp (Tango's engine with bf16 autocast
// and mixed_precision: true, issue 12 item 2).

local train_steps = 12;
local every = 4;

local optimizer = { type: "torch::AdamW", lr: 0.01, betas: [0.9, 0.95], eps: 1e-6 };
local lr_scheduler = { type: "torch::StepLR", step_size: 4, gamma: 0.5 };

local engine(kind, amp, mixed_precision) =
  local fsdp = { reshard_after_forward: true, mixed_precision: mixed_precision };
  {
    type: kind,
    optimizer: optimizer,
    lr_scheduler: lr_scheduler,
    amp: amp,
  } + (if kind == "torch" then {} else { fsdp_config: fsdp });

local model(kind, mixed_precision) =
  if kind == "torch" then { type: "fsc_tango::regressor" }
  else {
    type: kind + "::with_wrapped_modules",
    model: { type: "fsc_tango::regressor" },
    modules_to_wrap: ["blocks\\.[0-9]+"],
    fsdp_config: { reshard_after_forward: true, mixed_precision: mixed_precision },
    activation_checkpointing: true,
  };

local train(kind, amp=false, mixed_precision=false) = {
  type: "torch::train",
  model: model(kind, mixed_precision),
  training_engine: engine(kind, amp, mixed_precision),
  dataset_dict: { type: "ref", ref: "data" },
  train_dataloader: {
    batch_size: 4,  // per worker
    sampler: { type: "torch::DistributedSampler", shuffle: true, drop_last: true },
  },
  validation_split: "dev",
  validation_steps: 2,
  train_steps: train_steps,
  validate_every: every,
  checkpoint_every: every,
  log_every: 1,
  device_count: 2,
  // Not part of the step's identity, so the resume finds the crashed run's checkpoints.
  distributed_port: std.parseInt(std.extVar("FSC_TANGO_PORT")),
  callbacks: [{ type: "fsc_tango::recorder" }],
};

{
  steps: {
    data: { type: "fsc_tango::data" },
    torch_fp32: train("torch"),
    fairscale_fp32: train("fairscale"),
    fairscale_c_fp32: train("fairscale_c"),
    torch_bf16: train("torch", amp=true),
    fairscale_bf16: train("fairscale", amp=true),
    fairscale_c_bf16: train("fairscale_c", amp=true, mixed_precision=true),
    fairscale_bf16_mp: train("fairscale", amp=true, mixed_precision=true),
  },
}
