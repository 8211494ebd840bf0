"""Stand-ins for services and binaries that cannot run on a test machine.

- ``execbox.fakes.modal``, ``.daytona``, ``.vercel``: the remote-sandbox SDKs, each at the SDK's own
  boundary (same import names, classes, signatures and exceptions for what execbox uses). Install one with
  ``with execbox.fakes.modal.installed() as service:``; behind it commands really run in a local box
  (``_box.py``: private root, PID and network namespaces), and ``service.calls`` records what was sent.
  tests/fakes/test_fake_surfaces.py checks them against the real SDKs.
- ``execbox.fakes.apptainer``: a fake ``apptainer``/``singularity`` executable.

Nothing here is imported by execbox itself; of execbox the fakes import only execbox.files (removing a tree safely).
"""
