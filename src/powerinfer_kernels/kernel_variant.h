// kernel_variant.h - the kernel sources (attention.c, input_sparse.c, packed_matmul.c,
// sparse_kernels.c) are compiled once per ISA level (CMakeLists.txt: PI_KERNEL_LEVELS), with
// PI_VARIANT set to the level's name; their public functions then get the suffix _<level>,
// and kernel_levels.c calls the level this CPU runs. Without PI_VARIANT (the C test
// drivers, which compile one level each) the names stay plain. Each kernel source includes
// this first, before its own header, so declarations and definitions are renamed alike.
#pragma once

#ifdef PI_VARIANT
#define PI_VNAME3(n, v) n##_##v
#define PI_VNAME2(n, v) PI_VNAME3(n, v)
#define PI_VNAME(n)     PI_VNAME2(n, PI_VARIANT)

#define pi_attention           PI_VNAME(pi_attention)
#define pi_colmat_type_ok      PI_VNAME(pi_colmat_type_ok)
#define pi_colmat_plan         PI_VNAME(pi_colmat_plan)
#define pi_colmat_bind         PI_VNAME(pi_colmat_bind)
#define pi_colmat_fill         PI_VNAME(pi_colmat_fill)
#define pi_colmat_row          PI_VNAME(pi_colmat_row)
#define pi_colmat_force_scalar PI_VNAME(pi_colmat_force_scalar)
#define pi_colmat_simd         PI_VNAME(pi_colmat_simd)
#define pi_input_sparse_matmul PI_VNAME(pi_input_sparse_matmul)
#define pi_input_sparse_work_size PI_VNAME(pi_input_sparse_work_size)
#define pi_input_sparse_run    PI_VNAME(pi_input_sparse_run)
#define pi_prefetch            PI_VNAME(pi_prefetch)
#define pi_rows_dot            PI_VNAME(pi_rows_dot)
#define pi_rows_axpy           PI_VNAME(pi_rows_axpy)
#define pi_pack_available      PI_VNAME(pi_pack_available)
#define pi_pack_fits           PI_VNAME(pi_pack_fits)
#define pi_pack_type_of        PI_VNAME(pi_pack_type_of)
#define pi_pack_tensor         PI_VNAME(pi_pack_tensor)
#define pi_pack_type           PI_VNAME(pi_pack_type)
#define pi_pack_rows           PI_VNAME(pi_pack_rows)
#define pi_pack_cols           PI_VNAME(pi_pack_cols)
#define pi_pack_rows_exact     PI_VNAME(pi_pack_rows_exact)
#define pi_pack_q8_group_f32   PI_VNAME(pi_pack_q8_group_f32)
#define pi_packed_matmul       PI_VNAME(pi_packed_matmul)
#endif
