"""Every backend registration, one module per framework side (import = register)."""
import backends_torch  # noqa: F401
import backends_jax  # noqa: F401
import backends_bridge  # noqa: F401
import backends_jsd_torch  # noqa: F401
import backends_jsd_jax  # noqa: F401
import backends_jsd_bridge  # noqa: F401
