"""Conformance and dispatch (DESIGN.md section 5).

Conformance: every backend and wrapper exposes every protocol method (``backends.base.PROTOCOL_METHODS``,
SGLang 0.5.23's names) with a signature that accepts SGLang's call, and every protocol property; a backend
keeps a base implementation only where the base has a real default (``BASE_DEFAULTS``); a wrapper defines each
member itself (an inherited base method does not delegate) and the call reaches the child that owns it, with
arguments that child accepts. Children are replaced by strict
spies whose signatures are exactly the protocol's, so a wrapper that swallows a call, answers ``hasattr``
with False, or passes an unexpected keyword, fails.

Dispatch: in a real run, every full-attention layer reaches the full backend and every other layer the
linear backend (draft workers included).
"""

from __future__ import annotations

import functools
import inspect

from backends.base import BASE_DEFAULTS, PROTOCOL_METHODS, PROTOCOL_PROPERTIES, AttentionBackend
from backends.registry import Composition
from batch.forward_batch import ModelRunner
from batch.layers import make_layer
from batch.spec import BatchSpec, ForwardMode, is_recurrent
from batch.tbo_split import attach_tbo_children
from engine.execute import execute
from engine.materialize import materialize
from properties.blame import adapter_frame
from properties.verdict import Verdict



class Spy(AttentionBackend):
    """A child with exactly the protocol's signatures that records every call it receives."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.calls: list[tuple[str, tuple, dict]] = []

    def _rec(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))

    def called(self, name: str) -> bool:
        return any(c[0] == name for c in self.calls)

    def init_forward_metadata(self, forward_batch):
        self._rec("init_forward_metadata", forward_batch)

    def init_mha_chunk_metadata(self, forward_batch):  # the strictest hook: the batch only
        self._rec("init_mha_chunk_metadata", forward_batch)

    def forward(self, q=None, k=None, v=None, layer=None, forward_batch=None, save_kv_cache=True, **kwargs):
        self._rec("forward", layer=layer)
        return self.label

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._rec("forward_extend", layer=layer)
        return self.label

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self._rec("forward_decode", layer=layer)
        return self.label

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self._rec("init_forward_metadata_out_graph", forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        self._rec("init_forward_metadata_in_graph", forward_batch)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self._rec("init_cuda_graph_state")

    def get_cuda_graph_seq_len_fill_value(self):
        self._rec("get_cuda_graph_seq_len_fill_value")
        return 1

    @property
    def verify_mask(self):
        self._rec("verify_mask")
        return None

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        self._rec("update_verify_buffers_to_fill_after_draft")

    def update_mamba_state_after_mtp_verify(self, last_correct_step_indices, mamba_track_indices=None,
                                            mamba_steps_to_track=None, model=None, req_pool_indices=None):
        self._rec("update_mamba_state_after_mtp_verify")


LINEAR_FORWARD = ((), {"layer": None, "forward_batch": None, "mixed_qkv": None, "a": None, "b": None})


def _nodes(backend) -> list:
    out = [backend]
    if hasattr(backend, "primary"):
        for c in [backend.primary, *backend.children]:
            out += _nodes(c)
    elif hasattr(backend, "full_attn_backend"):
        out += _nodes(backend.full_attn_backend) + _nodes(backend.linear_attn_backend)
    return out


def _surface_problem(node) -> str | None:
    cls = type(node)
    is_wrapper = getattr(node, "is_wrapper", False)

    def kept_base(member: str, inherited: bool) -> str | None:
        if inherited and (is_wrapper or member not in BASE_DEFAULTS):
            why = "a wrapper must delegate it" if is_wrapper else "not implemented"
            return f"{cls.__name__}.{member} is the base's ({why})"
        return None

    for m, (args, kwargs) in PROTOCOL_METHODS.items():
        fn = getattr(node, m, None)
        if not callable(fn):
            return f"{cls.__name__} lacks {m}()"
        problem = kept_base(m, getattr(cls, m) is getattr(AttentionBackend, m))
        if problem:
            return problem
        try:
            inspect.signature(fn).bind(*args, **kwargs)
        except TypeError as e:
            return f"{cls.__name__}.{m} does not accept the canonical call: {e}"
    for p in PROTOCOL_PROPERTIES:
        attr = inspect.getattr_static(cls, p, None)
        if not isinstance(attr, property):
            return f"{cls.__name__}.{p} is not a property"
        problem = kept_base(p, attr is inspect.getattr_static(AttentionBackend, p))
        if problem:
            return problem
    kinds = node.capabilities.attention_kinds if hasattr(node, "capabilities") else {"linear"}
    if "linear" in kinds or is_wrapper:
        try:
            inspect.signature(node.forward).bind(*LINEAR_FORWARD[0], **LINEAR_FORWARD[1])
        except TypeError as e:
            return f"{cls.__name__}.forward does not accept the linear-attention call: {e}"
    if not is_wrapper:
        try:
            node.get_cuda_graph_seq_len_fill_value()
        except NotImplementedError as e:
            return f"{cls.__name__}.get_cuda_graph_seq_len_fill_value() raises: {e}"
        for p in PROTOCOL_PROPERTIES:
            try:
                getattr(node, p)
            except NotImplementedError as e:
                return f"{cls.__name__}.{p} raises: {e}"
        try:
            node.update_verify_buffers_to_fill_after_draft(None, 1)
        except NotImplementedError as e:
            return f"{cls.__name__}.update_verify_buffers_to_fill_after_draft() raises: {e}"
    return None


def _layer(layer_id: int, kind: str):
    from batch.forward_batch import LayerWeights
    from batch.spec import LinearLayer, MHALayer
    spec = MHALayer(layer_id, 2, 1, 8, 8) if kind == "mha" else LinearLayer(layer_id, 1, 1, 8, 8)
    return make_layer(spec, LayerWeights({}), ForwardMode.EXTEND)


def _reaches(node, spies: dict, method: str, owners: set, call) -> str | None:
    """Invoke ``call`` on the wrapper with fresh spies; the owners (and, for routed calls, only they) must
    receive ``method``."""
    for spy in spies.values():
        spy.calls.clear()
    call()
    for label, spy in spies.items():
        if label in owners and not spy.called(method):
            return f"{type(node).__name__}.{method} did not reach the {label} backend"
    return None


def _delegation_problem(node, spec: BatchSpec, device: str) -> str | None:
    """Swap the wrapper's children for strict spies and check each call reaches its owner."""
    if hasattr(node, "full_attn_backend"):
        return _hybrid_delegation(node, spec, device)
    if hasattr(node, "primary"):
        return _tbo_delegation(node, spec, device)
    return None


def _hybrid_delegation(node, spec: BatchSpec, device: str) -> str | None:
    fb = materialize(spec, device).forward_batch
    real = (node.full_attn_backend, node.linear_attn_backend)
    spies = {"full": Spy("full"), "linear": Spy("linear")}
    node.full_attn_backend, node.linear_attn_backend = spies["full"], spies["linear"]
    # A linear-only model has no full layer to route to; only the linear route is checked then.
    routes = [(min(node.full_attn_layers), "full")] if node.full_attn_layers else []
    routes.append((max(node.full_attn_layers, default=-1) + 1, "linear"))
    both = {"full", "linear"}
    checks = [
        ("init_forward_metadata", both, lambda: node.init_forward_metadata(fb)),
        ("init_cuda_graph_state", both, lambda: node.init_cuda_graph_state(4, 4)),
        ("init_forward_metadata_out_graph", both, lambda: _call(node, "init_forward_metadata_out_graph", fb)),
        ("init_forward_metadata_in_graph", both, lambda: _call(node, "init_forward_metadata_in_graph", fb)),
        ("get_cuda_graph_seq_len_fill_value", {"full"}, node.get_cuda_graph_seq_len_fill_value),
        ("verify_mask", {"full"}, lambda: node.verify_mask),
        ("update_verify_buffers_to_fill_after_draft", {"full"}, lambda: node.update_verify_buffers_to_fill_after_draft(None, 4)),
    ]
    try:
        if not hasattr(node, "init_mha_chunk_metadata"):
            return f"{type(node).__name__} has no init_mha_chunk_metadata: callers' hasattr guard would skip its full backend's planning"
        checks.append(("init_mha_chunk_metadata", {"full"}, lambda: node.init_mha_chunk_metadata(fb)))
        for method, owners, call in checks:
            problem = _reaches(node, spies, method, owners, call)
            if problem:
                return problem
        for m in ("forward", "forward_extend", "forward_decode"):
            for layer_id, owner in routes:
                other = "linear" if owner == "full" else "full"
                for spy in spies.values():
                    spy.calls.clear()
                getattr(node, m)(None, None, None, _layer(layer_id, "mha"), fb)
                if not spies[owner].called(m) or spies[other].called(m):
                    return f"{type(node).__name__}.{m} for layer {layer_id} did not reach only the {owner} backend"
    except TypeError as e:
        return f"{type(node).__name__} called a child with arguments it does not accept: {e}"
    finally:
        node.full_attn_backend, node.linear_attn_backend = real
    return None


def _tbo_delegation(node, spec: BatchSpec, device: str) -> str | None:
    real = (node.primary, node.children)
    spies = {"primary": Spy("primary"), "child A": Spy("child A"), "child B": Spy("child B")}
    node.primary, node.children = spies["primary"], [spies["child A"], spies["child B"]]
    layers = spec.layers if spec.draft_worker else spec.layers[:1]
    decode_spec = BatchSpec(ForwardMode.DECODE, (3, 5, 2, 4), (1, 1, 1, 1), layers, page_size=spec.page_size,
                            dtype=spec.dtype, draft_worker=spec.draft_worker, kv_cache_dtype=spec.kv_cache_dtype)
    fb = materialize(decode_spec, device).forward_batch
    attach_tbo_children(fb)
    everyone = set(spies)
    checks = [
        ("init_forward_metadata", everyone, lambda: node.init_forward_metadata(fb)),
        ("init_mha_chunk_metadata", {"primary"}, lambda: node.init_mha_chunk_metadata(fb)),
        ("forward", {"primary"}, lambda: node.forward(None, None, None, _layer(0, "mha"), fb)),
        ("forward", {"primary"}, lambda: node.forward(layer=_layer(0, "linear"), forward_batch=fb,
                                                      mixed_qkv=None, a=None, b=None)),
        ("forward_extend", {"primary"}, lambda: node.forward_extend(None, None, None, _layer(0, "mha"), fb)),
        ("forward_decode", {"primary"}, lambda: node.forward_decode(None, None, None, _layer(0, "mha"), fb)),
        ("init_cuda_graph_state", everyone, lambda: node.init_cuda_graph_state(4, 4)),
        ("init_forward_metadata_out_graph", everyone, lambda: _call(node, "init_forward_metadata_out_graph", fb)),
        ("init_forward_metadata_in_graph", everyone, lambda: _call(node, "init_forward_metadata_in_graph", fb)),
        ("get_cuda_graph_seq_len_fill_value", {"primary"}, node.get_cuda_graph_seq_len_fill_value),
        ("verify_mask", {"primary"}, lambda: node.verify_mask),
        ("update_verify_buffers_to_fill_after_draft", {"primary"},
         lambda: node.update_verify_buffers_to_fill_after_draft(None, 4)),
    ]
    try:
        for method, owners, call in checks:
            problem = _reaches(node, spies, method, owners, call)
            if problem:
                return problem
    except TypeError as e:
        return f"{type(node).__name__} called a child with arguments it does not accept: {e}"
    finally:
        node.primary, node.children = real
    return None


def _call(node, method: str, fb) -> None:
    """``method``'s canonical call (``PROTOCOL_METHODS``) on ``node``, with ``fb`` as the batch."""
    args, kwargs = PROTOCOL_METHODS[method]
    getattr(node, method)(*(fb if a == "forward_batch" else a for a in args), **kwargs)


def engine_protocol(base: type) -> list[str]:
    """The protocol of an engine, read from its installed base class: every public member it defines."""
    return sorted(n for n, _ in inspect.getmembers(base) if not n.startswith("_"))


def hidden_overrides(wrapper, children: list, base: type) -> list[tuple[str, str]]:
    """(member, child class) for each member a child overrides that the wrapper does not make reachable.

    A wrapper that delegates through ``__getattr__`` still answers a name its base class defines with the base's
    default (``__getattr__`` is never consulted for it): that counts as not reachable, as a missing method does.
    A member the wrapper copies onto the instance counts as reachable.
    """
    hidden = []
    for name in engine_protocol(base):
        default = inspect.getattr_static(base, name, None)
        reachable = inspect.getattr_static(type(wrapper), name, None) is not default or name in vars(wrapper)
        for child in children:
            if inspect.getattr_static(type(child), name, None) is not default and not reachable:
                hidden.append((name, type(child).__name__))
                break
    return hidden


def engine_conformance(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    """An engine's own classes against the protocol of its installed base class (SGLang's AttentionBackend)."""
    name = "conformance"
    case = materialize(spec, device)
    backend = composition.build(spec, ModelRunner.of(case.forward_batch, spec.layers))
    backend.init_forward_metadata(case.forward_batch)  # builds the engine's objects over the runner
    wrapper, children, base = backend.engine_objects()
    members = engine_protocol(base)
    if wrapper is None:
        leaf = children[0]
        # SGLang's overlap plan stream calls this on every speculative verify (eagle_worker_common.py:618); the
        # base raises, so a backend that serves target_verify must define it (a no-op where nothing needs fixing).
        method = "update_verify_buffers_to_fill_after_draft"
        if ForwardMode.TARGET_VERIFY in composition.support().modes and \
                inspect.getattr_static(type(leaf), method, None) is inspect.getattr_static(base, method, None):
            return Verdict(name, False, f"{type(leaf).__name__} serves target_verify but leaves {method} to "
                                        f"{base.__name__}, which raises NotImplementedError",
                           details={"hidden": [method]})
        return Verdict(name, True, f"{type(leaf).__name__}: a leaf, {len(members)} protocol members "
                                   f"of {base.__name__}, nothing to delegate")
    # Wrappers nest (SGLang's TBO over its hybrid): each wrapper is checked against its own children, which a
    # wrapper of the engine lists in ``attn_backend_list``.
    pairs, todo = [], [(wrapper, children)]
    while todo:
        w, kids = todo.pop(0)
        pairs.append((w, kids))
        todo += [(k, backend.engine_children(k)) for k in kids if backend.engine_children(k)
                 and not any(k is p for p, _ in pairs)]
    # Every problem is reported, not the first: a known one (the ledger) must not mask a new one beside it.
    problems, hidden_all, call_problems = [], [], 0
    for w, kids in pairs:
        hidden = hidden_overrides(w, kids, base)
        if hidden:
            listed = ", ".join(f"{m} (overridden by {c})" for m, c in hidden)
            problems.append(f"{type(w).__name__} does not make reachable what its children override: {listed}; "
                            f"the {base.__name__} default answers instead")
            hidden_all += [m for m, _ in hidden]
    # Protocol the base class does not define: what SGLang's callers probe for with hasattr. A wrapper must
    # answer it wherever a child does (a missing one is silently skipped by the caller), and take the call
    # the caller makes: init_mha_chunk_metadata(forward_batch) (models/deepseek_common/.../forward_mha.py).
    for member in backend.engine_probed_members():
        for w, kids in pairs:
            if hasattr(w, "full_attn_backend") and member in backend.engine_probed_on_full_backend():
                continue  # its callers look on the wrapper's full backend too (qsa/glue.py)
            owner = next((type(k).__name__ for k in backend.probe_owners(w, kids) if hasattr(k, member)), None)
            if owner and not hasattr(w, member):
                problems.append(f"{type(w).__name__} has no {member}, which its child {owner} has: SGLang's "
                                f"hasattr-guarded call skips it")
                hidden_all.append(member)
    top = wrapper if wrapper is not None else children[0]
    if hasattr(top, "init_mha_chunk_metadata"):
        try:
            top.init_mha_chunk_metadata(backend.mha_chunk_call_batch())
        except Exception as e:  # noqa: BLE001 - the caller's own call form failing is the finding
            problems.append(f"{type(top).__name__}.init_mha_chunk_metadata(forward_batch), as SGLang's model code "
                            f"calls it, raised {type(e).__name__}: {e}")
            call_problems += 1
    if problems:
        # A TBO wrapper's children are one class (its primary and two halves): a problem of theirs is said once
        problems = list(dict.fromkeys(problems))
        return Verdict(name, False, "; ".join(problems),
                       details={"hidden": list(dict.fromkeys(hidden_all)), "other_problems": call_problems})
    names = " and ".join(dict.fromkeys(type(w).__name__ for w, _ in pairs))
    return Verdict(name, True, f"{names} reach every one of the {len(members)} members of "
                               f"{base.__name__} that their children override")


def _declared_calls(sig: inspect.Signature) -> list[tuple[str, list[str], dict]]:
    """The calls a declaration lets a caller make, ``self`` left out: every positional parameter by position (the
    keyword-only ones by name), and the required ones by position with every defaulted one by name. ``*args`` and
    ``**kwargs`` add nothing: a caller can rely only on what is named."""
    params = list(sig.parameters.values())[1:]
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keyword_only = [p for p in params if p.kind is P.KEYWORD_ONLY]
    required = [p for p in positional if p.default is P.empty]
    return [("every parameter by position", [p.name for p in positional], {p.name: None for p in keyword_only}),
            ("the defaulted ones by name", [p.name for p in required],
             {p.name: None for p in positional + keyword_only if p not in required})]


def _raises_not_implemented(fn) -> bool:
    """Whether ``fn``'s body ends by raising NotImplementedError (an abstract member of an engine's base class)."""
    import ast
    import textwrap

    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return False
    last = body[-1] if body else None
    if not isinstance(last, ast.Raise) or last.exc is None:
        return False
    exc = last.exc.func if isinstance(last.exc, ast.Call) else last.exc
    return getattr(exc, "id", None) == "NotImplementedError"


def class_call_problems(cls: type, base: type, forwarders: list[type], probed: tuple[str, ...]) -> tuple[list[str], int]:
    """What keeps an engine's class from taking the calls its engine makes of it, read from the classes alone:

    - each member of ``base`` it overrides must take every call the base declares (``_declared_calls``): the
      engine's callers are written against the base;
    - each hasattr-probed member it has (``probed``) must take every call a wrapper in ``forwarders`` (the engine's
      hybrid wrappers, which pass a probed call on to their child with their own parameters) declares for it;
    - a full-attention backend must define ``forward_extend`` and ``forward_decode`` (or its own ``forward``) where
      the base's raise NotImplementedError: the base's ``forward`` dispatches every batch to one of them.

    Returns the problems and the number of (member, declaration) pairs checked."""
    problems, checked = [], 0
    declarations = [(m, base) for m, fn in inspect.getmembers(base, inspect.isfunction) if not m.startswith("_")]
    declarations += [(m, w) for m in probed for w in forwarders if inspect.isfunction(getattr(w, m, None))]
    failed = set()
    for member, owner in declarations:
        mine = inspect.getattr_static(cls, member, None)
        if member in failed:  # one problem a member: two wrappers forwarding the same call say it once
            continue
        if mine is None or mine is inspect.getattr_static(base, member, None):
            continue
        if isinstance(mine, (staticmethod, classmethod)) or not callable(mine):
            problems.append(f"{cls.__name__}.{member} is a {type(mine).__name__}, where {owner.__name__} declares "
                            f"a method")
            continue
        try:
            mine_sig, declared = inspect.signature(mine), inspect.signature(getattr(owner, member))
        except (TypeError, ValueError):  # a builtin's signature cannot be read: nothing to hold it to
            continue
        checked += 1
        for how, args, kwargs in _declared_calls(declared):
            try:
                mine_sig.bind(None, *args, **kwargs)
            except TypeError as e:
                call = ", ".join(args + [f"{k}=..." for k in kwargs])
                verb = "declares" if owner is base else "passes on to its child"
                problems.append(f"{cls.__name__}.{member}{_strip_self(mine_sig)} does not take the call "
                                f"{owner.__name__} {verb}, {member}({call}) ({how}): {e}")
                failed.add(member)
                break
    if inspect.getattr_static(cls, "forward", None) is inspect.getattr_static(base, "forward", None):
        for member in ("forward_extend", "forward_decode"):
            inherited = inspect.getattr_static(cls, member, None)
            if inherited is inspect.getattr_static(base, member, None) and _raises_not_implemented(inherited):
                problems.append(f"{cls.__name__} keeps {base.__name__}.{member}, which raises NotImplementedError: "
                                f"{base.__name__}.forward sends every {member.split('_')[1]} batch to it")
    return problems, checked


def _strip_self(sig: inspect.Signature) -> str:
    params = list(sig.parameters.values())[1:]
    return "(" + ", ".join(p.name if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) else str(p).split(":")[0]
                           for p in params) + ")"


@functools.cache
def assigned_on_instances(cls: type) -> frozenset[str]:
    """Names a class's methods (its bases' included) assign on the instance, ``self.NAME = ...``: a wrapper that
    copies a child's value onto itself in ``__init__`` (SGLang's wrappers do, for ``needs_cpu_seq_lens`` and
    ``extend_dummy_seqs_capped_by_req_pool``) makes that member reachable without defining it on its class."""
    import ast
    import textwrap

    names: set[str] = set()
    for klass in cls.__mro__:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            names.update(t.attr for t in targets if isinstance(t, ast.Attribute)
                         and isinstance(t.value, ast.Name) and t.value.id == "self")
    return frozenset(names)


def class_hidden(wrapper: type, children: list[type], owners: list[type], base: type,
                 probed: tuple[str, ...], fallback: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(member, child class) for each member a child class overrides (or, probed with hasattr, has) that the wrapper
    class leaves unreachable, read from the classes alone: ``hidden_overrides`` for a wrapper that was never built.
    ``fallback``: probed members whose callers also look on a wrapper's ``full_attn_backend``: not owed by one.
    A member the wrapper's methods assign on the instance counts as reachable; so does a probed member where the
    wrapper delegates through ``__getattr__`` (TboAttnBackend's does, from 0.5.15). ``owners``: the children whose
    probed members it owes (a prefill/decode split: its prefill child's)."""
    copied = assigned_on_instances(wrapper)
    hidden = []
    for member in engine_protocol(base):
        default = inspect.getattr_static(base, member, None)
        if inspect.getattr_static(wrapper, member, None) is not default or member in copied:
            continue
        owner = next((c for c in children if inspect.getattr_static(c, member, None) is not default), None)
        if owner is not None:
            hidden.append((member, owner.__name__))
    delegates = getattr(wrapper, "__getattr__", None) is not None
    holds_full = "full_attn_backend" in copied  # its callers look there too for some members (probed_on_full_backend)
    for member in probed:
        if holds_full and member in fallback:
            continue
        owner = next((c for c in owners if hasattr(c, member) or member in assigned_on_instances(c)), None)
        if owner is not None and not (hasattr(wrapper, member) or member in copied or delegates):
            hidden.append((member, owner.__name__))
    return hidden


def _engine_class_of(composition: Composition) -> list[type]:
    """The SGLang classes a composition's leaf stands for: a class-level leaf's own (``engine_classes``); a built
    leaf's through the registry name its adapter builds (its linear leaves have none: SGLang builds them inside its
    hybrid wrapper, and their own members are checked by the built rows of that wrapper)."""
    from backends.registry import leaf_class

    leaf = leaf_class(composition.name)
    if hasattr(leaf, "engine_classes"):
        return leaf.engine_classes()
    return []


def class_conformance(composition: Composition) -> Verdict:
    """A composition with a class-level leaf (backends/sglang/classes.py): each class its engine's factory returns
    that imports here, held to the calls its engine makes of it (``class_call_problems``); under a wrapper, the
    wrapper's class must also make reachable what those classes override (``class_hidden``)."""
    from backends.sglang import runtime

    name = "conformance"
    sgl = runtime.load()
    base = sgl.AttentionBackend
    leaves = _leaves_of(composition)
    classes = [cls for leaf in leaves for cls in _engine_class_of(leaf)]
    if not classes:
        return Verdict(name, False, f"no class of {composition} imports here")
    forwarders = [w for w in (sgl.HybridLinearAttnBackend, sgl.HybridAttnBackend) if w is not None]
    probed = runtime.probed_members()
    problems, checked = [], 0
    for cls in dict.fromkeys(classes):
        found, n = class_call_problems(cls, base, forwarders, probed)
        problems += found
        checked += n
    call_problems, hidden_all = len(problems), []
    wrappers = {"tbo": sgl.TboAttnBackend, "hybrid": sgl.HybridLinearAttnBackend, "pd": sgl.HybridAttnBackend}
    for node in _wrapper_nodes(composition):
        wrapper = wrappers[node.name]
        if wrapper is None:
            return Verdict(name, False, f"the installed SGLang has no {node.name}() wrapper class")
        kids = [cls for child in node.children for cls in _classes_under(child)]
        owners = [cls for cls in _classes_under(node.children[0])] if node.name == "pd" else kids
        hidden = class_hidden(wrapper, kids, owners, base, probed, runtime.probed_on_full_backend())
        if hidden:
            listed = ", ".join(f"{m} (of {c})" for m, c in hidden)
            problems.append(f"{wrapper.__name__} does not make reachable what its children have: {listed}; the "
                            f"{base.__name__} default answers, or SGLang's hasattr-guarded call skips it")
            hidden_all += [m for m, _ in hidden]
    if problems:
        return Verdict(name, False, "; ".join(problems), details={"hidden": list(dict.fromkeys(hidden_all)),
                                                                  "other_problems": call_problems})
    names = ", ".join(dict.fromkeys(c.__name__ for c in classes))
    return Verdict(name, True, f"{names}: every call SGLang declares for the {checked} member(s) they override "
                               f"binds; forward_extend and forward_decode defined"
                               + ("; every wrapper reaches what they have" if _wrapper_nodes(composition) else ""))


def _leaves_of(composition: Composition) -> list[Composition]:
    return [composition] if composition.is_leaf else [l for c in composition.children for l in _leaves_of(c)]


def _wrapper_nodes(composition: Composition) -> list[Composition]:
    if composition.is_leaf:
        return []
    return [composition] + [w for c in composition.children for w in _wrapper_nodes(c)]


def _classes_under(composition: Composition) -> list[type]:
    return [cls for leaf in _leaves_of(composition) for cls in _engine_class_of(leaf)]


def conformance(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    name = "conformance"
    if composition.support().class_only:
        return class_conformance(composition)
    if composition.support().plan_only:  # its classes are read as a class-level leaf's, then built and planned
        verdict = class_conformance(composition)
        if not verdict.ok:
            return verdict
    if composition.engine != "harness":
        return engine_conformance(composition, spec, device)
    backend = composition.build(spec, ModelRunner.of(materialize(spec, device).forward_batch, spec.layers))
    nodes = _nodes(backend)
    for node in nodes:
        problem = _surface_problem(node)
        if problem:
            return Verdict(name, False, problem)
    for node in nodes:
        if getattr(node, "is_wrapper", False):
            problem = _delegation_problem(node, spec, device)
            if problem:
                return Verdict(name, False, problem)
    return Verdict(name, True, f"{len(nodes)} backend object(s) expose and delegate every protocol method")


_ROUTED = ("init_forward_metadata", "forward", "forward_extend", "forward_decode")
# How a short-conv layer reaches its backend: it asks for its state by layer id and runs its own kernels
# (SGLang's ShortConvHybridAttnBackend.conv_state_metadata, 0.5.22 on), never through forward
_STATE_REQUESTS = ("conv_state_metadata",)


class _CallRecorder:
    """Forwards everything to a real backend, recording the routed calls it receives (method, layer id). It passes
    for the backend's class (a model may assert it: Nemotron-H's mamba layer checks its linear backend is SGLang's
    Mamba2AttnBackend before handing it its mixer)."""

    def __init__(self, inner, calls: list) -> None:
        self._inner, self._calls = inner, calls

    @property
    def __class__(self):
        return type(self._inner)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name in _STATE_REQUESTS:
            def requested(layer_id, *args, **kwargs):
                self._calls.append((name, layer_id))
                return attr(layer_id, *args, **kwargs)
            return requested
        if name not in _ROUTED:
            return attr

        def recorded(*args, **kwargs):
            layer = kwargs.get("layer", args[3] if len(args) > 3 else None)
            # a layer object, or a mixer handed over with its layer id (Mamba2AttnBackend.forward)
            layer_id = kwargs.get("layer_id") if layer is None else getattr(layer, "layer_id", None)
            self._calls.append((name, layer_id))
            return attr(*args, **kwargs)
        return recorded


def _forwarded(calls: list) -> set:
    """The layer ids a recorder's forward methods (or state requests) saw."""
    return {layer for method, layer in calls if method != "init_forward_metadata" and layer is not None}


def dispatch(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    name = "dispatch"
    case = materialize(spec, device)
    backend = composition.build(spec, ModelRunner.of(case.forward_batch, spec.layers))
    if composition.engine != "harness":
        # An engine's hybrid objects exist once its adapter has planned a batch; the recorders go on them.
        backend.init_forward_metadata(case.forward_batch)
        hybrids = [n.inner for n in _nodes(backend) if hasattr(getattr(n, "inner", None), "full_attn_backend")]
    else:
        hybrids = [n for n in _nodes(backend) if hasattr(n, "full_attn_backend")]
    if not hybrids:
        return Verdict(name, True, "no hybrid wrapper in this composition")
    full_calls, linear_calls = [], []
    # Short-conv layers that read their state without asking a backend (SGLang's LFM2 layer up to 0.5.21 reads the
    # request pool itself): nothing to route, so they must reach neither backend's forward
    unrouted = set()
    for h in hybrids:
        h.full_attn_backend = _CallRecorder(h.full_attn_backend, full_calls)
        linear = _CallRecorder(h.linear_attn_backend, linear_calls)
        h.linear_attn_backend = linear
        if hasattr(h, "short_conv_backend"):  # the same object as its linear child, asked by its conv layers
            h.short_conv_backend = linear
        elif not hasattr(h, "conv_state_metadata"):
            unrouted |= {l.layer_id for l in spec.layers if l.kind == "short_conv"}
    error = None
    try:
        execute(composition, case, backend=backend)
    except Exception as e:  # a misrouted layer usually crashes in the wrong backend; report where it went
        if adapter_frame(e, composition) is not None:
            raise  # the harness's own code failed: Property.run reports it as an adapter error, not a misroute
        error = f"{type(e).__name__}: {e}"
    full_seen, linear_seen = _forwarded(full_calls), _forwarded(linear_calls)
    full_ids = {l.layer_id for l in spec.layers if not is_recurrent(l)}
    linear_ids = {l.layer_id for l in spec.layers if is_recurrent(l)}
    wrong = sorted((full_seen & linear_ids) | (linear_seen & full_ids))
    if wrong:
        return Verdict(name, False, f"layer id(s) {wrong} reached the wrong backend "
                                    f"(full got {sorted(full_seen)}, linear got {sorted(linear_seen)})")
    if error:
        return Verdict(name, False, f"run crashed: {error}")
    missing = sorted((full_ids - full_seen) | (linear_ids - linear_seen - unrouted))
    if missing and spec.batch_size:
        return Verdict(name, False, f"layer id(s) {missing} never reached their backend")
    return Verdict(name, True, f"full layers {sorted(full_ids)} and linear layers {sorted(linear_ids)} dispatched correctly")


# The routing a server promises for ``--prefill-attention-backend P --decode-attention-backend D`` (SGLang's
# server-argument docs; ``--speculative-attention-mode prefill`` is the default): decode steps and idle batches on
# D, everything that extends (prefill, mixed chunked prefill, draft extends) and speculative verify on P.
_SPLIT_OWNER = {ForwardMode.DECODE: "decode", ForwardMode.IDLE: "decode"}
def mode_dispatch(composition: Composition, spec: BatchSpec, device: str) -> Verdict:
    """An engine's prefill/decode split (``pd(P, D)``): a batch is planned, and each of its layers run, by the
    backend the server configured for its mode, and by no other."""
    name = "mode_dispatch"
    case = materialize(spec, device)
    backend = composition.build(spec, ModelRunner.of(case.forward_batch, spec.layers))
    backend.init_forward_metadata(case.forward_batch)  # builds the engine's split over the runner
    split = backend.inner
    owner = _SPLIT_OWNER.get(spec.mode, "prefill")
    other = "decode" if owner == "prefill" else "prefill"
    calls = {"prefill": [], "decode": []}
    real = split.prefill_backend, split.decode_backend
    split.prefill_backend = _CallRecorder(real[0], calls["prefill"])
    split.decode_backend = _CallRecorder(real[1], calls["decode"])
    try:
        execute(composition, case, backend=backend)
    finally:
        split.prefill_backend, split.decode_backend = real
    names = {"prefill": composition.children[0], "decode": composition.children[1]}
    if calls[other]:
        method, layer = calls[other][0]
        return Verdict(name, False, f"the {spec.mode.value} batch reached the {other} backend ({names[other]}): "
                                    f"{method}" + (f" of layer {layer}" if layer is not None else "") +
                       f"; the server configured {names[owner]} for {spec.mode.value}")
    if spec.batch_size:  # an empty idle batch is neither planned nor run
        got = {m for m, _ in calls[owner]}
        ran = _forwarded(calls[owner])
        attention = {l.layer_id for l in spec.layers}
        if "init_forward_metadata" not in got:
            return Verdict(name, False, f"the {owner} backend ({names[owner]}) never planned the {spec.mode.value} "
                                        f"batch it ran")
        if ran != attention:
            return Verdict(name, False, f"layers {sorted(attention - ran)} of the {spec.mode.value} batch never "
                                        f"reached the {owner} backend ({names[owner]})")
    return Verdict(name, True, f"{spec.mode.value}: planned and run by the {owner} backend ({names[owner]}) only")
