/* A backend from the future: its table says ABI 99 (test_backend.cpp: the
 * version-mismatch error).  Nothing in the table may be called. */
#include <pvgpu/backend.h>

static const struct pvgpu_backend_ops ops = {
	.abi_version = 99,
	.size = sizeof(struct pvgpu_backend_ops),
	.name = "abi99",
};

const struct pvgpu_backend_ops *pvgpu_backend_entry(pvgpu_u32 host_abi_version)
{
	(void)host_abi_version;
	return &ops;
}
