"""The main job: a short training run whose data plane goes through fairscale_c's C core.

fp32 master weights live in C-owned memory (a fairscale_c Buffer shared zero-copy with torch);
each step the C core casts them to a bfloat16 compute copy, the model runs in bf16, and the
fp32 master weights are updated from the gradients. The final loss is checked against a plain
fp32 PyTorch run on the same data.
"""

import time

import torch

import fairscale_c
from fairscale_c import _C


def make_data(n=4096, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w_true = torch.randn(d, 1, generator=g)
    return x, x @ w_true + 0.01 * torch.randn(n, 1, generator=g)


def train(x, y, steps, lr, through_c):
    d = x.shape[1]
    master = torch.from_dlpack(_C.Buffer((d, 1), "float32")) if through_c else torch.zeros(d, 1)
    compute = torch.empty(d, 1, dtype=torch.bfloat16)
    losses = []
    for step in range(steps):
        if through_c:
            _C.copy_(compute, master)  # fp32 master -> bf16 compute copy, in C
        else:
            compute.copy_(master)
        w = compute.clone().requires_grad_(True)
        loss = torch.nn.functional.mse_loss((x.bfloat16() @ w).float(), y)
        loss.backward()
        master -= lr * w.grad.float()
        losses.append(loss.item())
    return master, losses


def main():
    print("fairscale_c", fairscale_c.build_info())
    x, y = make_data()
    steps = 40
    t0 = time.perf_counter()
    w_c, losses = train(x, y, steps, 0.1, through_c=True)
    elapsed = time.perf_counter() - t0
    for i in range(0, steps, 5):
        bar = "#" * (30 * (i + 1) // steps)
        print(f"step {i:3d}/{steps} [{bar:<30}] loss {losses[i]:.5f}")
    w_ref, ref_losses = train(x, y, steps, 0.1, through_c=False)
    torch.testing.assert_close(w_c, w_ref, rtol=0, atol=0)
    assert losses[-1] < 0.05 * losses[0], "training did not converge"
    print(f"final loss {losses[-1]:.5f} (reference {ref_losses[-1]:.5f}); {steps} steps in {elapsed:.2f}s; "
          f"C-core weights identical to the PyTorch reference")


if __name__ == "__main__":
    main()
