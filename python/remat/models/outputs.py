"""Hugging Face's recorded outputs (``output_hidden_states``, ``output_attentions``,
``output_router_logits``) on a patched model.

Facts (transformers 5.24, transformers/utils/output_capturing.py): a model whose forward is
decorated with ``capture_outputs`` records these outputs with forward hooks that it installs, once
and lazily, on the modules its ``_can_record_outputs`` table names (decoder-layer classes for hidden
states, attention classes for attentions, router classes for MoE router logits); the hooks append
to a per-call collector only while one is active. A replacement layer is none of those classes, so
without help a patched model silently returns fewer hidden states (0 instead of 4 for a 3-layer
Llama) and no attentions.

What this module does, whatever the family (it reads Hugging Face's own hooks, never a list of
classes, so families added later, such as mixture-of-experts layers, are covered):

- :func:`install_recorders` (before the swap) makes Hugging Face install its hooks on the stock
  modules now, where its first ``output_hidden_states=True`` call would, so they exist on the
  originals; :func:`remove_recorders` (from :func:`remat.unpatch`) takes them off again, so an
  unpatched model carries the hooks it carried before patching. Hugging Face's hooks are closures,
  which pickle cannot save; the ones installed here are held as :class:`Recorder` objects (the
  same closure, rebuilt from its arguments when loaded), so a patched model pickles
  (``torch.save(model)``, ``copy.deepcopy``) whenever the stock model does.
- :func:`carry_recorders` (after the swap) gives each replacement the recording hooks its
  original carried itself (a decoder layer's hidden-state hook: the replacement returns the same
  hidden states), and those of the original's submodules to the replacement's submodules at the
  same path that are instances of the same class (a MoE router built as a subclass of the stock
  router, returning the logits first as stock does). remat's fused attention is no such module
  and forms no attention probabilities, so the attention hooks have nothing to record. Each
  replacement then checks, whenever a collector asks for one of those outputs, that every
  recorder of its original recorded: a key with no carrier raises ValueError before the forward,
  one whose carrier recorded nothing (an attention replacement returns ``(output, None)``) raises
  after it. Nothing is returned short silently.
- :func:`drop_recorders` (before unpatching) removes what :func:`carry_recorders` added.

With the patched model's attention implementation set to ``"remat"`` (remat.patch), Hugging
Face's config refuses ``output_attentions`` before any forward, for any implementation but eager;
the checks here are what still refuses it inside a recorded call that gets past that.
"""

import inspect
import sys

from torch import nn

_RECORDER_SOURCE = "transformers.utils.output_capturing"
_CARRIED = "_remat_recorded_outputs"
# Hugging Face's mark of a model whose recording hooks are installed (maybe_install_capturing_hooks),
# and remat's mark of a model where install_recorders set it.
_HF_INSTALLED = "_output_capturing_hooks_installed"
_INSTALLED_HERE = "_remat_installed_recorders"
# The names transformers has given the function that installs one recording hook.
_HOOK_INSTALLERS = ("install_output_capuring_hook", "install_output_capturing_hook")

_WHY = {
    "attentions": "remat's fused attention never forms the attention probabilities",
    "cross_attentions": "remat's fused attention never forms the attention probabilities",
}


def _output_capturing():
    """transformers' output_capturing module when transformers is already imported (a model that
    holds Hugging Face modules has imported it), else None."""
    if "transformers.modeling_utils" not in sys.modules:
        return None
    try:
        from transformers.utils import output_capturing
    except ImportError:  # a transformers without output capturing (4.x) records nothing by hooks
        return None
    return output_capturing


def _defined_in_output_capturing(function):
    """Whether ``function``'s code is in transformers' output_capturing module (read from the code
    object: ``functools.wraps`` copies ``__module__`` from the wrapped function)."""
    code = getattr(function, "__code__", None)
    return code is not None and code.co_filename == sys.modules[_RECORDER_SOURCE].__file__


def _is_recorder(hook):
    return isinstance(hook, Recorder) or _defined_in_output_capturing(hook)


def _closure(function):
    """The free variables of a closure: ``{name: value}``."""
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in cells), strict=True))


def _recorder_key(hook):
    """The collector key (``"hidden_states"``, ``"attentions"``, ...) a Hugging Face recording hook
    appends to: the ``key`` its closure holds (a :class:`Recorder`'s ``key`` argument)."""
    if isinstance(hook, Recorder):
        return hook.arguments["key"]
    return _closure(hook)["key"]


def _hook_installer():
    """transformers' function that installs one recording hook, ``(module, key, index, ...)``, or None."""
    capturing = sys.modules[_RECORDER_SOURCE]
    return next((getattr(capturing, name) for name in _HOOK_INSTALLERS if hasattr(capturing, name)), None)


def _built_hook(arguments):
    """The closure transformers' installer makes for ``arguments`` (installed on a scratch module,
    taken from there)."""
    scratch = nn.Module()
    _hook_installer()(scratch, **arguments)
    (hook,) = scratch._forward_hooks.values()
    return hook


class Recorder:
    """One of Hugging Face's output-recording forward hooks, in a form pickle can save: the
    arguments transformers' installer made the closure from (``key``, ``index``, ...), and that
    closure, rebuilt by the installer whenever the object is built or loaded; calls run the closure,
    so what is recorded is exactly what Hugging Face's hook records."""

    def __init__(self, arguments):
        self.arguments = dict(arguments)
        self._hook = _built_hook(self.arguments)

    @classmethod
    def of(cls, hook):
        """The Recorder for Hugging Face's closure ``hook``, or None where it cannot be rebuilt from its
        free variables (a transformers whose installer or hook differs from what this reads)."""
        installer = _hook_installer()
        if installer is None:
            return None
        names = [name for name in inspect.signature(installer).parameters if name != "module"]
        values = _closure(hook)
        if not all(name in values for name in names):
            return None
        recorder = cls({name: values[name] for name in names})
        return recorder if recorder._hook.__code__ is hook.__code__ else None

    def __call__(self, module, args, output):
        return self._hook(module, args, output)

    def __getstate__(self):
        return {"arguments": self.arguments}

    def __setstate__(self, state):
        self.__init__(state["arguments"])


def install_recorders(model):
    """Installs Hugging Face's output recording hooks in ``model`` now, where Hugging Face would on
    the first call that asks for an output: for each ``PreTrainedModel`` whose forward is decorated
    with ``capture_outputs``, outermost first, ``maybe_install_capturing_hooks`` (a no-op where they
    are installed already). Call before replacing modules, so the hooks land on the stock modules.
    Each hook installed here is held as a :class:`Recorder` (in place: same hook id, same order),
    and each model whose hooks were installed here is marked for :func:`remove_recorders`."""
    capturing = _output_capturing()
    if capturing is None:
        return
    pretrained = sys.modules["transformers.modeling_utils"].PreTrainedModel
    modules = list(model.modules())
    hooks_before = {id(module): set(module._forward_hooks) for module in modules}
    unmarked = [module for module in modules if isinstance(module, pretrained) and not getattr(module, _HF_INSTALLED,
                                                                                                  False)]
    for module in modules:  # pre-order: an outer model before the models it holds
        if isinstance(module, pretrained) and _captures_outputs(type(module).forward):
            capturing.maybe_install_capturing_hooks(module)
    for module in unmarked:
        if module.__dict__.get(_HF_INSTALLED):
            module.__dict__[_INSTALLED_HERE] = True
    for module in modules:
        hooks = module._forward_hooks
        for hook_id in hooks.keys() - hooks_before[id(module)]:
            if _defined_in_output_capturing(hooks[hook_id]):
                hooks[hook_id] = Recorder.of(hooks[hook_id]) or hooks[hook_id]


def remove_recorders(model):
    """Takes off ``model`` what :func:`install_recorders` put on it: every :class:`Recorder` hook,
    and Hugging Face's installed mark where install_recorders set it (Hugging Face then installs
    its hooks again on the first call that asks for an output, as on a model never patched). Hooks
    Hugging Face installed itself (a recorded call before patching) are its closures, and stay."""
    for module in model.modules():
        for hook_id, hook in list(module._forward_hooks.items()):
            if isinstance(hook, Recorder):
                _remove_forward_hook(module, hook_id)
        if module.__dict__.pop(_INSTALLED_HERE, False):
            module.__dict__.pop(_HF_INSTALLED, None)


def _remove_forward_hook(module, hook_id):
    """What ``RemovableHandle.remove()`` does for a forward hook of ``module``."""
    for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called):
        hooks.pop(hook_id, None)


def _captures_outputs(forward):
    """Whether ``forward`` (through its ``functools.wraps`` chain) is wrapped by ``capture_outputs``."""
    while forward is not None:
        if _defined_in_output_capturing(forward):
            return True
        forward = getattr(forward, "__wrapped__", None)
    return False


def carry_recorders(replacement, original):
    """Gives ``replacement`` the Hugging Face recording hooks found in ``original``'s subtree, and a
    check that every one of them records (see the module docstring). A hook on ``original`` itself
    goes on ``replacement``; one on a submodule goes on the replacement's submodule at the same
    path when that is an instance of the submodule's class (a MoE router built as a subclass of the
    stock router), and is kept as it is when the replacement holds that very submodule. Returns the
    collector keys concerned (empty where the original recorded nothing)."""
    if _output_capturing() is None:
        return ()
    recorders, carried, added_at = {}, set(), []
    inside = {id(module) for module in replacement.modules()}
    for path, module in original.named_modules():
        hooks = [hook for hook in module._forward_hooks.values() if _is_recorder(hook)]
        if not hooks:
            continue
        keys = [_recorder_key(hook) for hook in hooks]
        for key in keys:  # each recording module records once per call
            recorders[key] = recorders.get(key, 0) + 1
        if path and id(module) in inside:
            carried.update(keys)  # shared module: its hooks are on it already
            continue
        target = replacement if not path else _submodule(replacement, path)
        if target is None or (path and not isinstance(target, type(module))):
            continue  # nothing in the replacement produces this output: the check refuses it
        for hook in hooks:
            target.register_forward_hook(hook)
        carried.update(keys)
        added_at.append(path)
    if not recorders:
        return ()
    check = _RecordingCheck(type(original).__name__, type(replacement).__name__, recorders, carried)
    replacement.register_forward_pre_hook(check.before)
    replacement.register_forward_hook(check.after)
    object.__setattr__(replacement, _CARRIED, tuple(added_at))
    return tuple(sorted(recorders))


def _submodule(module, path):
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def drop_recorders(replacement):
    """Removes what :func:`carry_recorders` registered on ``replacement`` and its submodules (found
    by path and by the hooks themselves, so a deep copy of a patched model unpatches its own copy)."""
    added_at = replacement.__dict__.pop(_CARRIED, None)
    if added_at is None:
        return
    for hooks in (replacement._forward_hooks, replacement._forward_pre_hooks):
        for hook_id, hook in list(hooks.items()):
            if isinstance(getattr(hook, "__self__", None), _RecordingCheck):
                del hooks[hook_id]
    for path in added_at:
        target = replacement if not path else _submodule(replacement, path)
        for hook_id, hook in list(target._forward_hooks.items()):
            if _is_recorder(hook):
                _remove_forward_hook(target, hook_id)


class _RecordingCheck:
    """The replacement's forward pre- and post-hooks: while a Hugging Face collector asks for one
    of the keys the original recorded, a key with no carrier in the replacement raises before the
    forward, and a key whose list grew by less than the number of the original's recorders
    raises after it."""

    def __init__(self, original_name, replacement_name, recorders, carried):
        self.recorders, self.carried = recorders, carried
        self.names = (original_name, replacement_name)
        self.lengths = []  # a stack of the collector's list lengths at each forward's start

    def _asked(self):
        # Hugging Face's per-call collector: a dict of lists by key while a recorded call runs.
        collected = sys.modules[_RECORDER_SOURCE]._active_collector.get()
        if not collected:
            return None, ()
        return collected, [key for key in self.recorders if key in collected]

    def _refuse(self, key):
        original, replacement = self.names
        why = _WHY.get(key, f"{replacement} does not produce what {original}'s '{key}' recorder reads")
        raise ValueError(f"output_{key} is not available on a remat-patched model: {why}. Call "
                         f"remat.unpatch(model) to record it, or leave output_{key} off")

    def before(self, module, args):
        collected, asked = self._asked()
        if not asked:
            return
        for key in asked:
            if key not in self.carried:
                self._refuse(key)
        self.lengths.append({key: len(collected[key]) for key in asked})

    def after(self, module, args, output):
        collected, asked = self._asked()
        if not asked or not self.lengths:
            return
        start = self.lengths.pop()
        for key in asked:
            if len(collected[key]) - start.get(key, 0) < self.recorders[key]:
                self._refuse(key)
