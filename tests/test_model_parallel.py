"""fairscale_c.nn.model_parallel on CPU ranks (1, 2 and 4; model-parallel size 1, 2 and 4, and
2 x 2 with data parallelism): every layer against plain torch with the full weight on the same
data (outputs, input gradients, each rank's slice of the weight and bias gradients), the
vocabulary-parallel cross-entropy against F.cross_entropy, a column -> row parallel MLP trained
for a few steps against the unsplit MLP, the group layout, the seeded random streams and
checkpointing that replays them, and bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import clean_dev_shm, not_close, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")
TOL = dict(rtol=1e-5, atol=1e-6)


def _data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _master(seed, out_features, in_features):
    """The full weight a layer built right after torch.manual_seed(seed) initialises."""
    torch.manual_seed(seed)
    w = torch.empty(out_features, in_features)
    nn.init.xavier_normal_(w)
    return w


class _Checks:
    def __init__(self):
        self.failures = []

    def close(self, got, want, what):
        if msg := not_close(got.detach(), want.detach(), **TOL):
            self.failures.append(f"{what}: {msg}")

    def true(self, ok, what):
        if not ok:
            self.failures.append(what)


def _linear_checks(mpu, check, rank, size):
    d_in, d_out, rows = 8, 12, 5
    x0, w_out = _data(1, rows, d_in), _data(2, rows, d_out)
    # ColumnParallelLinear: output features split
    for gather in (True, False):
        torch.manual_seed(10)
        layer = mpu.ColumnParallelLinear(d_in, d_out, gather_output=gather, keep_master_weight_for_test=True)
        master = _master(10, d_out, d_in)
        check.close(layer.master_weight if size > 1 else layer.weight, master, "column master weight")
        x, ref_x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        ref_w = master.clone().requires_grad_()
        ref_b = torch.zeros(d_out, requires_grad=True)
        ref_y = F.linear(ref_x, ref_w, ref_b)
        part = slice(rank * d_out // size, (rank + 1) * d_out // size)
        y = layer(x)
        check.close(y, ref_y if gather else ref_y[:, part], f"column forward (gather={gather})")
        (ref_y * w_out).sum().backward()
        (y * (w_out if gather else w_out[:, part])).sum().backward()
        check.close(x.grad, ref_x.grad, f"column input grad (gather={gather})")
        check.close(layer.weight.grad, ref_w.grad[part], f"column weight grad (gather={gather})")
        check.close(layer.bias.grad, ref_b.grad[part], f"column bias grad (gather={gather})")
        check.close(layer.get_master_weight(), master, "column get_master_weight")
    # RowParallelLinear: input features split
    for parallel_input in (False, True):
        torch.manual_seed(20)
        layer = mpu.RowParallelLinear(d_in, d_out, input_is_parallel=parallel_input)
        master = _master(20, d_out, d_in)
        part = slice(rank * d_in // size, (rank + 1) * d_in // size)
        x, ref_x = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        ref_w = master.clone().requires_grad_()
        ref_b = torch.zeros(d_out, requires_grad=True)
        ref_y = F.linear(ref_x, ref_w, ref_b)
        y = layer(x[:, part] if parallel_input else x)
        check.close(y, ref_y, f"row forward (input_is_parallel={parallel_input})")
        (ref_y * w_out).sum().backward()
        (y * w_out).sum().backward()
        want_x_grad = ref_x.grad.clone()
        if parallel_input:  # this rank's slice only
            want_x_grad = torch.zeros_like(want_x_grad)
            want_x_grad[:, part] = ref_x.grad[:, part]
        check.close(x.grad, want_x_grad, f"row input grad (input_is_parallel={parallel_input})")
        check.close(layer.weight.grad, ref_w.grad[:, part], "row weight grad")
        check.close(layer.bias.grad, ref_b.grad, "row bias grad")
        check.close(layer.get_master_weight(), master, "row get_master_weight")


def _embedding_checks(mpu, check, rank, size):
    vocab, dim = 16, 8
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(3))
    w_out = _data(4, 3, 7, dim)
    for cls, split_dim in ((mpu.VocabParallelEmbedding, 0), (mpu.ParallelEmbedding, 1)):
        torch.manual_seed(30)
        layer = cls(vocab, dim)
        master = _master(30, vocab, dim).requires_grad_()
        ref = F.embedding(ids, master)
        out = layer(ids)
        check.close(out, ref, f"{cls.__name__} forward")
        (ref * w_out).sum().backward()
        (out * w_out).sum().backward()
        n = (vocab if split_dim == 0 else dim) // size
        want = master.grad.narrow(split_dim, rank * n, n)
        check.close(layer.weight.grad, want, f"{cls.__name__} weight grad")
    # padding_idx names a global id: its row, on the rank that holds it, gets no gradient (given
    # as vocab - 3 and as -3, the same row, in the last rank's part)
    ids = torch.cat([ids, torch.tensor([[vocab - 3, 1, 0, vocab - 3, 2, 5, 1]])])
    for pad in (vocab - 3, -3):
        torch.manual_seed(30)
        layer = mpu.VocabParallelEmbedding(vocab, dim, padding_idx=pad)
        master = _master(30, vocab, dim).requires_grad_()
        w = _data(4, 4, 7, dim)
        (F.embedding(ids, master, padding_idx=vocab - 3) * w).sum().backward()
        (layer(ids) * w).sum().backward()
        n = vocab // size
        check.close(layer.weight.grad, master.grad[rank * n : (rank + 1) * n], f"padding_idx={pad} weight grad")
    for bad in (vocab, -1):
        try:
            layer(torch.tensor([[0, bad]]))
            check.true(False, f"VocabParallelEmbedding took id {bad}")
        except IndexError as exc:
            check.true(f"index {bad} out of range for a vocabulary of {vocab}" in str(exc), str(exc))
    try:
        mpu.VocabParallelEmbedding(vocab, dim, padding_idx=vocab)
        check.true(False, "VocabParallelEmbedding took padding_idx=vocab")
    except ValueError as exc:
        check.true("padding_idx=16 must be within num_embeddings=16" in str(exc), str(exc))


def _cross_entropy_checks(mpu, check, rank, size):
    vocab = 16
    logits0 = _data(5, 4, 3, vocab) * 3
    target = torch.randint(0, vocab, (4, 3), generator=torch.Generator().manual_seed(6))
    weight = _data(7, 4, 3)
    ref_logits = logits0.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction="none").view(4, 3)
    (ref * weight).sum().backward()
    part = slice(rank * vocab // size, (rank + 1) * vocab // size)
    mine = logits0[..., part].clone().requires_grad_()
    before = mine.detach().clone()
    loss = mpu.vocab_parallel_cross_entropy(mine, target)
    check.true(torch.equal(mine.detach(), before), "cross-entropy changed its input logits")
    check.close(loss, ref, "vocab-parallel cross-entropy")
    (loss * weight).sum().backward()
    check.close(mine.grad, ref_logits.grad[..., part], "vocab-parallel cross-entropy grad")
    for bad in (vocab, -100):  # no ignore_index (as in FairScale): refused, not a made-up loss
        try:
            mpu.vocab_parallel_cross_entropy(mine, torch.full((4, 3), bad))
            check.true(False, f"vocab_parallel_cross_entropy took target {bad}")
        except IndexError as exc:
            check.true(f"index {bad} out of range for a vocabulary of {vocab}" in str(exc), str(exc))


def _mlp_checks(mpu, check, rank, size):
    """Column (split output) -> GeLU -> Row (split input): 3 SGD steps against the unsplit MLP."""
    d, hidden = 8, 16
    torch.manual_seed(40)
    up = mpu.ColumnParallelLinear(d, hidden, gather_output=False)
    torch.manual_seed(41)
    down = mpu.RowParallelLinear(hidden, d, input_is_parallel=True)
    ref_up, ref_down = nn.Linear(d, hidden), nn.Linear(hidden, d)
    with torch.no_grad():
        ref_up.weight.copy_(_master(40, hidden, d))
        ref_down.weight.copy_(_master(41, d, hidden))
        ref_up.bias.zero_()
        ref_down.bias.zero_()
    params = list(up.parameters()) + list(down.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(list(ref_up.parameters()) + list(ref_down.parameters()), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = _data(50 + step, 6, d), _data(60 + step, 6, d)
        for f, o in ((lambda t: down(F.gelu(up(t))), opt), (lambda t: ref_down(F.gelu(ref_up(t))), ref_opt)):
            o.zero_grad()
            F.mse_loss(f(x), y).backward()
            o.step()
    check.close(up.get_master_weight(), ref_up.weight, "MLP up weight after 3 steps")
    check.close(down.get_master_weight(), ref_down.weight, "MLP down weight after 3 steps")
    check.close(down.bias, ref_down.bias, "MLP down bias after 3 steps")
    part = slice(rank * hidden // size, (rank + 1) * hidden // size)
    check.close(up.bias, ref_up.bias[part], "MLP up bias slice after 3 steps")


def _random_checks(mpu, check, rank, world, model_size):
    import torch.distributed as dist

    mpu.model_parallel_cuda_manual_seed(123)
    default = torch.rand(4)
    with mpu.get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    after = torch.rand(4)
    both = torch.stack([default, forked, after])
    everyone = [torch.empty_like(both) for _ in range(world)]
    dist.all_gather(everyone, both)
    mp_rank = mpu.get_model_parallel_rank()
    for other in range(world):
        same_mp_rank = other % model_size == mp_rank
        check.true(torch.equal(everyone[other][0], default), "default stream differs across ranks")
        check.true(torch.equal(everyone[other][2], after), "fork moved the default stream")
        check.true(
            torch.equal(everyone[other][1], forked) == same_mp_rank,
            f"model-parallel stream of rank {other} vs {rank}: expected {'equal' if same_mp_rank else 'different'}",
        )
    # checkpoint replays dropout inside and outside the tracked stream
    layer = nn.Linear(8, 8)

    def block(t):
        with mpu.get_cuda_rng_tracker().fork():
            t = F.dropout(layer(t), p=0.5, training=True)
        return F.dropout(t, p=0.3, training=True)

    x = _data(70, 5, 8).requires_grad_()
    states = (torch.get_rng_state(), mpu.get_cuda_rng_tracker().get_states())
    out = mpu.checkpoint(block, x)
    out.sum().backward()
    grads = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    torch.set_rng_state(states[0])
    mpu.get_cuda_rng_tracker().set_states(states[1])
    plain = block(x)
    plain.sum().backward()
    check.true(torch.equal(out, plain), "checkpointed output differs from the plain run")
    check.true(torch.equal(grads[0], x.grad) and torch.equal(grads[1], layer.weight.grad), "checkpoint gradients")


def _job(rank, world, model_size, pipeline_length=1):
    import torch.distributed as dist

    import fairscale_c.nn.model_parallel as mpu

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    check = _Checks()
    try:
        check.true(not mpu.model_parallel_is_initialized(), "initialised before initialize_model_parallel")
        mpu.initialize_model_parallel(model_size, pipeline_length)
        size, mp_rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        data = world // (model_size * pipeline_length)
        grid = torch.arange(world).reshape(data, pipeline_length, model_size)
        i, j, k = (int(t[0]) for t in torch.where(grid == rank))
        layout = {
            "model": dist.get_process_group_ranks(mpu.get_model_parallel_group()),
            "data": dist.get_process_group_ranks(mpu.get_data_parallel_group()),
            "pipeline": mpu.get_pipeline_parallel_ranks(),
        }
        want = {"model": grid[i, j].tolist(), "data": grid[:, j, k].tolist(), "pipeline": grid[i, :, k].tolist()}
        check.true(layout == want, f"groups {layout}, expected {want}")
        check.true(mpu.get_model_parallel_src_rank() == grid[i, j, 0].item(), "model parallel src rank")
        check.true(mpu.get_data_parallel_world_size() == data and mpu.get_data_parallel_rank() == i, "dp rank")
        if pipeline_length == 1:
            _linear_checks(mpu, check, mp_rank, size)
            _embedding_checks(mpu, check, mp_rank, size)
            _cross_entropy_checks(mpu, check, mp_rank, size)
            _mlp_checks(mpu, check, mp_rank, size)
            _random_checks(mpu, check, rank, world, model_size)
        if size > 1:  # sizes the ranks do not divide, and sizes that are no sizes, named
            cases = [
                (lambda: mpu.ColumnParallelLinear(4, 2 * size + 1), ValueError, f"'out_features'={2 * size + 1}"),
                (lambda: mpu.RowParallelLinear(2 * size + 1, 4), ValueError, f"'in_features'={2 * size + 1}"),
                (lambda: mpu.VocabParallelEmbedding(2 * size + 1, 4), ValueError, f"'num_embeddings'={2 * size + 1}"),
                (lambda: mpu.ParallelEmbedding(8, 2 * size + 1), ValueError, f"'embedding_dim'={2 * size + 1}"),
                (lambda: mpu.ColumnParallelLinear(4, -2), ValueError, "'out_features'=-2"),
                (lambda: mpu.ColumnParallelLinear(4, 4.0), TypeError, "'out_features' must be an int, got float"),
            ]
            for make, exc_type, words in cases:
                try:
                    make()
                    check.failures.append(f"no error for {words}")
                except exc_type as exc:
                    check.true(words in str(exc), str(exc))
        try:
            mpu.initialize_model_parallel(model_size)
            check.failures.append("no error for a second initialize_model_parallel")
        except RuntimeError as exc:
            check.true("already initialised" in str(exc), str(exc))
        mpu.destroy_model_parallel()
        check.true(not mpu.model_parallel_is_initialized(), "still initialised after destroy_model_parallel")
    finally:
        dist.destroy_process_group()
    return check.failures


@pytest.mark.parametrize("world,model_size,pipeline_length", [(1, 1, 1), (2, 2, 1), (4, 4, 1), (4, 2, 1), (4, 2, 2)])
def test_model_parallel_layers_equal_plain_torch(world, model_size, pipeline_length):
    results = run_ranks(_job, world, model_size, pipeline_length, timeout=300)
    assert results == [[]] * world


def test_model_parallel_errors():
    import fairscale_c.nn.model_parallel as mpu

    with pytest.raises(RuntimeError, match="model parallel is not initialised"):
        mpu.get_model_parallel_group()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        mpu.initialize_model_parallel(2)
    with pytest.raises(ValueError, match="7 is not divisible by 2"):
        mpu.utils.divide_and_check_no_remainder(7, 2)
    with pytest.raises(ValueError, match="rng state 'nope' is not added"):
        with mpu.get_cuda_rng_tracker().fork("nope"):
            pass


def _cuda_job(rank, world):
    """CUDA tensors on NCCL: the MLP block, the cross-entropy and the CUDA random streams."""
    import torch.distributed as dist

    import fairscale_c.nn.model_parallel as mpu

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    check = _Checks()
    try:
        mpu.initialize_model_parallel(world)
        d, hidden = 8, 16
        torch.manual_seed(40)
        up = mpu.ColumnParallelLinear(d, hidden, gather_output=False).cuda()
        torch.manual_seed(41)
        down = mpu.RowParallelLinear(hidden, d, input_is_parallel=True).cuda()
        ref_up, ref_down = _master(40, hidden, d).requires_grad_(), _master(41, d, hidden).requires_grad_()
        x = _data(50, 6, d)
        xc = x.cuda().requires_grad_()
        out = down(F.gelu(up(xc)))
        ref = F.linear(F.gelu(F.linear(x, ref_up)), ref_down)
        check.close(out.cpu(), ref, "CUDA MLP forward")
        (out * out).sum().backward()
        (ref * ref).sum().backward()
        part = slice(rank * hidden // world, (rank + 1) * hidden // world)
        check.close(up.weight.grad.cpu(), ref_up.grad[part], "CUDA column weight grad")
        check.close(down.weight.grad.cpu(), ref_down.grad[:, part], "CUDA row weight grad")
        _cross_entropy_checks_cuda(mpu, check, rank, world)
        mpu.model_parallel_cuda_manual_seed(7)
        default = torch.rand(4, device="cuda").cpu()
        with mpu.get_cuda_rng_tracker().fork():
            forked = torch.rand(4, device="cuda").cpu()
        both = [torch.empty(2, 4) for _ in range(world)]
        dist.all_gather(both, torch.stack([default, forked]))
        check.true(torch.equal(both[0][0], both[1][0]), "CUDA default stream differs across ranks")
        check.true(not torch.equal(both[0][1], both[1][1]), "CUDA model-parallel stream equal across ranks")
        mpu.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return check.failures


def _cross_entropy_checks_cuda(mpu, check, rank, size):
    vocab = 16
    logits0, target = _data(5, 4, vocab) * 3, torch.randint(0, vocab, (4,), generator=torch.Generator().manual_seed(6))
    ref_logits = logits0.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    ref.sum().backward()
    part = slice(rank * vocab // size, (rank + 1) * vocab // size)
    mine = logits0[:, part].cuda().requires_grad_()
    loss = mpu.vocab_parallel_cross_entropy(mine, target.cuda())
    loss.sum().backward()
    check.close(loss.cpu(), ref, "CUDA vocab-parallel cross-entropy")
    check.close(mine.grad.cpu(), ref_logits.grad[:, part], "CUDA vocab-parallel cross-entropy grad")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_parallel_on_cuda_ranks_equals_plain_torch():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    assert run_ranks(_cuda_job, 2, env=nccl_env, timeout=240) == [[]] * 2
