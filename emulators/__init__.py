"""emulators: tools that answer after the latency PolyTrace recorded, without doing the work.

- `toolenv_core.polytrace`: typed records and streaming readers/writers for every PolyTrace format.
- `toolenv_core.latency`: latency model specs (a discriminated union on `kind`), seeded samplers,
  faults, and the `Profile` object a fit writes, a config names and `PUT .../profile` takes.
- `emulators.fit` / `emulators.describe`: `toolenv emulators fit` and `describe`.
- `emulators.search`, `emulators.reward`: the two emulated tools; `emulators.app.create_app`
  serves both (`toolenv emulators serve`), and the gateway mounts the same app in-process.
- `benchmarks.emulators_bench`: the open-loop fidelity bench (`make bench`).
"""
