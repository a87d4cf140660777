"""How a public call travels: its declaration (:mod:`~iris.calls.declarations`), the decorator
that gives its method ``group=``, ``async_op=`` and a compiled form (:mod:`~iris.calls.routing`),
its custom operators (:mod:`~iris.calls.operators`, naming the object they run on by a handle:
:mod:`~iris.calls.handles`), the handles of asynchronous calls (:mod:`~iris.calls.work`) and the
repeats of identical eager calls (:mod:`~iris.calls.repeats`)."""
