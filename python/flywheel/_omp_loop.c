/*
 * _omp_loop.c: a host parallel loop (flywheel.h's fw_parallel_fn) on OpenMP, for the Python
 * package's flywheel.use_openmp_threads(). Built as _fwomp.so against the compiler's OpenMP
 * runtime (gcc: libgomp.so.1). In a torch process the loader keeps one libgomp.so.1 for
 * torch and this module (torch's pip wheel ships its own under that soname), so flywheel's
 * parallel loops run on the threads torch keeps awake instead of a second pool that competes
 * with them for the cores. Built without OpenMP (no runtime found), fw_omp_max_threads()
 * says 0 and the Python call refuses.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef void (*fw_omp_task)(void *arg, int64_t t);

#if defined(__GNUC__)
#define FW_OMP_EXPORT __attribute__((visibility("default")))
#else
#define FW_OMP_EXPORT
#endif

/* Runs task(arg, t) for t in [0, ntasks) on the team OpenMP gives a region here (torch:
 * torch.get_num_threads() threads), each t once; inside a region that cannot nest, on the
 * calling thread, one after another (what fw_parallel_fn allows). */
FW_OMP_EXPORT void fw_omp_loop(void *host, int64_t ntasks, fw_omp_task task, void *arg)
{
    (void)host;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1)
#endif
    for (int64_t t = 0; t < ntasks; t++)
        task(arg, t);
}

/* The team size a region started here would have (0: built without OpenMP). */
FW_OMP_EXPORT int fw_omp_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 0;
#endif
}
