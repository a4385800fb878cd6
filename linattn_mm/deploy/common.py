"""What every inference form shares: the class it converts, the conditions of a call, and the
caches of values computed from the parameters."""
import torch

from linattn_mm.ops.common import grad_needed

__all__ = ['InferenceForm']


class InferenceForm:
    """Mixin of the inference forms. A form subclasses the module class it converts
    (``base_class``) and overrides its ``forward`` only: it adds no parameter or buffer, so a
    converted module keeps its state dict, its keys and its parameters, and
    :func:`linattn_mm.deploy.revert` gives the module its class back.

    Conditions of a call, checked by :meth:`check_inference` (an error names the one that fails):
    eval mode, no gradient needed, no autocast (unless ``autocast_ok``), the device type the
    module was converted for, and, for forms that write into preallocated buffers
    (``same_dtype``), floating inputs of the parameters' dtype.
    """

    #: the class whose instances this form converts (set by each form)
    base_class = None
    #: the device type of the form: 'cpu' or 'cuda'
    device_type = 'cpu'
    #: forms that accept autocast (the Triton cores read half-precision inputs)
    autocast_ok = False
    #: forms that need the input in the parameters' dtype (float32 / float64)
    same_dtype = False

    @classmethod
    def unsupported(cls, module):
        """Why ``module`` (an instance of :attr:`base_class`) has no such inference form (a
        sentence), or None when it can be converted."""
        return None

    def check_inference(self, x):
        """Raise a ``RuntimeError`` that names the problem when this call is not an inference call
        of the kind the module was converted for."""
        owner = f'{type(self).__name__} (converted by linattn_mm.deploy.convert)'
        fix = 'call linattn_mm.deploy.revert(model) to train or to run it otherwise'
        if self.training:
            raise RuntimeError(f'{owner} is in training mode; call model.eval(), or {fix}')
        if grad_needed(x, *self.parameters()):
            raise RuntimeError(f'{owner} runs without gradients: call it under torch.no_grad() '
                               f'or torch.inference_mode(), or {fix}')
        if not self.autocast_ok and torch.is_autocast_enabled(x.device.type):
            raise RuntimeError(f'{owner} does not run under autocast; {fix}')
        if not self.runs_on(x):
            raise RuntimeError(f'{owner} was converted for {self.device_type} and got a '
                               f'{x.device.type} input; convert again for that device, or {fix}')
        if self.same_dtype:
            if x.dtype not in (torch.float32, torch.float64):
                raise RuntimeError(f'{owner} runs float32 / float64 inputs, got {x.dtype}; {fix}')
            wrong = {str(p.dtype) for p in self.parameters() if p.dtype != x.dtype}
            if wrong:
                raise RuntimeError(f'{owner} got a {x.dtype} input and parameters in '
                                   f'{", ".join(sorted(wrong))}; convert model and input to one '
                                   f'dtype, or {fix}')

    def runs_on(self, x):
        """Whether the form runs on the device of ``x``."""
        return x.device.type == self.device_type

    def cached(self, name, key_tensors, compute, extra_key=()):
        """``compute()``, kept while ``extra_key`` is the same and ``key_tensors`` (the small
        parameters it reads, on CPU) hold the same values: compared with a copy, so that every
        update counts (another tensor, a checkpoint load, and writes through ``.data`` as an EMA
        swap makes them, which no version counter sees)."""
        key = tuple(extra_key) + tuple((t.dtype, t.device, t.shape) for t in key_tensors)
        store = self.__dict__.setdefault('_inference_cache', {})
        hit = store.get(name)
        if hit is not None and hit[0] == key and all(
                torch.equal(t, seen) for t, seen in zip(key_tensors, hit[1])):
            return hit[2]
        value = compute()
        store[name] = (key, [t.detach().clone() for t in key_tensors], value)
        return value
