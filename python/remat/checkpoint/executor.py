"""Runs a chain of blocks under a checkpoint schedule (remat.checkpoint.schedule) as one autograd
Function: the forward runs the schedule's spine, the backward reverses the tree, re-running blocks
as the schedule says, with each block's RNG and the autocast state restored on every re-run so
that recomputed forwards reproduce the original exactly."""

import torch

from remat import memory
from remat.autograd.common import refuse_double_backward
from remat.checkpoint.schedule import Segment


class _AutocastState:
    """Autocast settings (CPU and CUDA: enabled and dtype) at the original forward."""

    def __init__(self):
        self.settings = [(dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in ("cpu", "cuda")]

    def __enter__(self):
        self._contexts = [torch.autocast(dev, dtype=dtype, enabled=enabled)
                          for dev, enabled, dtype in self.settings if enabled or torch.is_autocast_enabled(dev)]
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)
        return False


class ChainRunner:
    """State of one forward/backward of a chain under a plan.

    Args:
        blocks: sequence of callables, each taking and returning one tensor.
        plan: the schedule tree (Segment / Split) over ``len(blocks)`` blocks.
        preserve_rng_state: record the CPU and CUDA RNG state before each block's first run and
            restore it for every re-run (dropout masks repeat exactly).
    """

    def __init__(self, blocks, plan, preserve_rng_state=True):
        self.blocks = list(blocks)
        self.plan = plan
        self.preserve_rng_state = preserve_rng_state
        self.params = []
        self.block_params = []
        seen = {}
        for block in self.blocks:
            own = []
            for p in (block.parameters() if isinstance(block, torch.nn.Module) else ()):
                if p.requires_grad:
                    if id(p) not in seen:
                        seen[id(p)] = len(self.params)
                        self.params.append(p)
                    own.append(seen[id(p)])
            self.block_params.append(sorted(set(own)))
        self.rng_states = {}
        self.autocast = None
        self.state = {}
        self.param_grads = [None] * len(self.params)

    def _rng_devices(self, x):
        return [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []

    def _run_block(self, i, x):
        """Block i on x. The first run records the RNG state; re-runs restore it."""
        if not self.preserve_rng_state:
            return self.blocks[i](x)
        if i not in self.rng_states:
            devices = self._rng_devices(x)
            self.rng_states[i] = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], devices)
            return self.blocks[i](x)
        cpu_state, cuda_states, devices = self.rng_states[i]
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_state)
            for d, s in zip(devices, cuda_states):
                torch.cuda.set_rng_state(s, d)
            return self.blocks[i](x)

    def _advance(self, start, end, x):
        """Blocks [start, end) without a graph."""
        with torch.no_grad():
            for i in range(start, end):
                x = self._run_block(i, x)
        return x

    def _tape(self, start, end, x):
        """Blocks [start, end) with a graph; returns (leaf input, output)."""
        x_in = x.detach()
        if x_in.is_floating_point() or x_in.is_complex():
            x_in.requires_grad_(True)
        out = x_in
        with torch.enable_grad():
            for i in range(start, end):
                out = self._run_block(i, out)
        return x_in, out

    def _backprop(self, x_in, out, grad_out, start, end):
        param_index = sorted({j for i in range(start, end) for j in self.block_params[i]})
        inputs = ([x_in] if x_in.requires_grad else []) + [self.params[j] for j in param_index]
        if not out.requires_grad or not inputs:
            return None
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        if x_in.requires_grad:
            grad_x, grads = grads[0], grads[1:]
        else:
            grad_x = None
        for j, g in zip(param_index, grads):
            if g is not None:
                self.param_grads[j] = g if self.param_grads[j] is None else self.param_grads[j] + g
        return grad_x

    def forward(self, x):
        """The forward pass along the plan's spine; returns the chain's output."""
        self.autocast = _AutocastState()
        node = self.plan
        while not isinstance(node, Segment):
            if node.keep_left:
                x_in, mid = self._tape(node.start, node.mid, x)
                self.state[node] = ("kept", x_in, mid)
                x = mid.detach()
            else:
                x = self._advance(node.start, node.mid, x)
                self.state[node] = ("checkpoint", x, memory.note_held(x))
            node = node.right
        if node.recompute:
            self.state[node] = ("input", x, memory.note_held(x))
            return self._advance(node.start, node.end, x)
        x_in, out = self._tape(node.start, node.end, x)
        self.state[node] = ("kept", x_in, out)
        return out.detach()

    def backward(self, x0, grad_out):
        """Reverses the whole plan; returns the gradient for the chain's input."""
        with self.autocast:
            grad = self._reverse(self.plan, x0, grad_out, on_spine=True)
        self.state.clear()
        return grad

    def _reverse(self, node, x, grad_out, on_spine):
        if isinstance(node, Segment):
            saved = self.state.pop(node, None) if on_spine else None
            if saved is not None and saved[0] == "kept":
                return self._backprop(saved[1], saved[2], grad_out, node.start, node.end)
            if saved is not None:
                memory.note_released(saved[2])
            x_in, out = self._tape(node.start, node.end, x)
            return self._backprop(x_in, out, grad_out, node.start, node.end)
        held = ()
        if on_spine:
            kind, first, second = self.state.pop(node)
            if kind == "kept":
                x_in, mid = first, second
                x_mid = mid.detach()
            else:
                x_mid, held = first, second
            del first, second  # x_mid must be the checkpoint's last reference when it is released
        elif node.keep_left:
            x_in, mid = self._tape(node.start, node.mid, x)
            x_mid = mid.detach()
        else:
            x_mid = self._advance(node.start, node.mid, x)
            held = memory.note_held(x_mid)
        grad_mid = self._reverse(node.right, x_mid, grad_out, on_spine)
        memory.note_released(held)
        del x_mid
        if node.keep_left:
            return self._backprop(x_in, mid, grad_mid, node.start, node.mid)
        return self._reverse(node.left, x, grad_mid, on_spine=False)


class _ChainFunction(torch.autograd.Function):
    """The chain as one autograd node; saves nothing through save_for_backward (the runner holds
    the checkpoints). ``ctx.inputs``: x and the parameters, the tensors the gradients depend on
    (for refuse_double_backward; x's storage is kept anyway as x0, the parameters live)."""

    @staticmethod
    def forward(ctx, runner, x, *params):
        ctx.runner = runner
        ctx.x0 = x.detach()
        ctx.x0_version = x._version
        ctx.inputs = (x, *params)
        return runner.forward(x)

    @staticmethod
    @refuse_double_backward("remat's checkpointed chain (remat.checkpoint_sequential, a patched model's spans)",
                            graph_inputs=lambda ctx: ctx.inputs)
    def backward(ctx, grad_out):
        runner = ctx.runner
        if runner is None:
            raise RuntimeError(
                "remat.checkpoint_sequential: backward through this chain a second time; its "
                "checkpoints were released after the first backward (use retain_graph only outside it)"
            )
        ctx.runner = None
        if ctx.x0._version != ctx.x0_version:
            raise RuntimeError(
                "remat.checkpoint_sequential: the chain's input was modified in place after the forward; "
                "the backward re-runs blocks from it and would compute wrong gradients"
            )
        grad_x = runner.backward(ctx.x0, grad_out)
        return (None, grad_x, *runner.param_grads)


def run_chain(blocks, x, plan, preserve_rng_state=True):
    """Runs ``blocks`` on ``x`` under ``plan``; differentiable in x and the blocks' parameters."""
    runner = ChainRunner(blocks, plan, preserve_rng_state)
    return _ChainFunction.apply(runner, x, *runner.params)
