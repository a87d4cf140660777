"""What runs iris programs and checks them: the ``iris`` command (:mod:`~iris.tools.cli`), its demo
(:mod:`~iris.tools.demo`), ``iris.spawn`` (:mod:`~iris.tools.spawn`) and ``iris compile-check``
(:mod:`~iris.tools.compile_check`)."""
