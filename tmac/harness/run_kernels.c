/* Runs functions of a tmac kernel library without Python or TVM: for arm64 libraries under qemu-aarch64.
 *
 *   run_kernels LIB.so DIR
 *
 * DIR/calls.txt lists calls, one per line: `FUNCTION NARGS` followed by NARGS argument lines, each a tensor
 * `NAME DTYPE NDIM DIM...` (DTYPE: float32 | float16 | int8 | uint8) or a scalar `=f VALUE` (float) / `=i VALUE` (int).
 * A tensor is read from DIR/NAME.bin when that file exists and starts zeroed otherwise; a name used again
 * refers to the same tensor. After all calls every
 * tensor is written to DIR/NAME.out. The library's thread-pool and workspace hooks are filled with pthreads
 * and malloc, as libtvm_runtime would fill them (2 threads, or TMAC_NUM_THREADS: 1 makes instruction counts exact);
 * errors raised by the kernels are printed and exit with 2.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>

typedef struct { void *sync_handle; int32_t num_task; } ParallelEnv;
typedef int (*ParallelLambda)(int task_id, ParallelEnv *env, void *cdata);

#define NUM_THREADS 2
#define MAX_TENSORS 64

typedef struct { ParallelLambda f; ParallelEnv *env; void *cdata; int task; int rc; } Task;

static void *run_task(void *arg) {
  Task *t = (Task *)arg;
  t->rc = t->f(t->task, t->env, t->cdata);
  return NULL;
}

static int parallel_launch(ParallelLambda f, void *cdata, int num_task) {
  if (num_task <= 0) {
    const char *threads = getenv("TMAC_NUM_THREADS");
    num_task = threads && atoi(threads) > 0 ? atoi(threads) : NUM_THREADS;
  }
  ParallelEnv env = {NULL, num_task};
  pthread_t threads[64];
  Task tasks[64];
  if (num_task > 64) num_task = 64;
  for (int i = 0; i < num_task; i++) {
    tasks[i] = (Task){f, &env, cdata, i, 0};
    pthread_create(&threads[i], NULL, run_task, &tasks[i]);
  }
  int rc = 0;
  for (int i = 0; i < num_task; i++) {
    pthread_join(threads[i], NULL);
    rc |= tasks[i].rc;
  }
  return rc;
}

static void *alloc_workspace(int dev_type, int dev_id, uint64_t nbytes, int code, int bits) {
  (void)dev_type; (void)dev_id; (void)code; (void)bits;
  void *p = NULL;
  return posix_memalign(&p, 64, nbytes ? nbytes : 1) == 0 ? p : NULL;
}

static int free_workspace(int dev_type, int dev_id, void *ptr) {
  (void)dev_type; (void)dev_id;
  free(ptr);
  return 0;
}

/* Kernels call this on their error paths (argument checks); normally libtvm_ffi provides it. */
void TVMFFIErrorSetRaisedFromCStrParts(const char *kind, const char **parts, int32_t n) {
  fprintf(stderr, "%s: ", kind);
  for (int i = 0; i < n; i++) fputs(parts[i] ? parts[i] : "", stderr);
  fputc('\n', stderr);
}

typedef struct { char name[64]; DLTensor t; int64_t shape[8]; size_t nbytes; } Tensor;
static Tensor tensors[MAX_TENSORS];
static int num_tensors = 0;

static int dtype_of(const char *s, DLDataType *dt) {
  if (!strcmp(s, "float32")) *dt = (DLDataType){kDLFloat, 32, 1};
  else if (!strcmp(s, "float16")) *dt = (DLDataType){kDLFloat, 16, 1};
  else if (!strcmp(s, "int8")) *dt = (DLDataType){kDLInt, 8, 1};
  else if (!strcmp(s, "uint8")) *dt = (DLDataType){kDLUInt, 8, 1};
  else return -1;
  return 0;
}

static Tensor *tensor(const char *dir, const char *name, FILE *calls) {
  char dtype[16];
  int ndim;
  if (fscanf(calls, "%15s %d", dtype, &ndim) != 2 || ndim < 1 || ndim > 8) return NULL;
  int64_t shape[8];
  size_t count = 1;
  for (int i = 0; i < ndim; i++) {
    if (fscanf(calls, "%ld", &shape[i]) != 1 || shape[i] < 0) return NULL;
    count *= (size_t)shape[i];
  }
  for (int i = 0; i < num_tensors; i++)
    if (!strcmp(tensors[i].name, name)) return &tensors[i];
  if (num_tensors == MAX_TENSORS) return NULL;
  Tensor *t = &tensors[num_tensors++];
  strcpy(t->name, name);
  if (dtype_of(dtype, &t->t.dtype)) return NULL;
  memcpy(t->shape, shape, sizeof(shape));
  t->nbytes = count * t->t.dtype.bits / 8;
  t->t.data = alloc_workspace(0, 0, t->nbytes, 0, 0);
  memset(t->t.data, 0, t->nbytes);
  t->t.device = (DLDevice){kDLCPU, 0};
  t->t.ndim = ndim;
  t->t.shape = t->shape;
  t->t.strides = NULL;
  t->t.byte_offset = 0;
  char path[1024];
  snprintf(path, sizeof(path), "%s/%s.bin", dir, name);
  FILE *f = fopen(path, "rb");
  if (f) {
    size_t got = fread(t->t.data, 1, t->nbytes, f);
    fclose(f);
    if (got != t->nbytes) { fprintf(stderr, "%s: expected %zu bytes, read %zu\n", path, t->nbytes, got); return NULL; }
  }
  return t;
}

int main(int argc, char **argv) {
  if (argc != 3) { fprintf(stderr, "usage: %s LIB.so DIR\n", argv[0]); return 1; }
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (!lib) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
  void **hook;
  if ((hook = dlsym(lib, "__TVMBackendParallelLaunch"))) *hook = (void *)parallel_launch;
  if ((hook = dlsym(lib, "__TVMBackendAllocWorkspace"))) *hook = (void *)alloc_workspace;
  if ((hook = dlsym(lib, "__TVMBackendFreeWorkspace"))) *hook = (void *)free_workspace;

  char path[1024], fname[128];
  snprintf(path, sizeof(path), "%s/calls.txt", argv[2]);
  FILE *calls = fopen(path, "r");
  if (!calls) { perror(path); return 1; }
  int nargs;
  while (fscanf(calls, "%127s %d", fname, &nargs) == 2) {
    if (nargs < 0 || nargs > 16) { fprintf(stderr, "bad argument count %d\n", nargs); return 1; }
    TVMFFIAny args[16];
    for (int i = 0; i < nargs; i++) {
      char name[64];
      memset(&args[i], 0, sizeof(TVMFFIAny));
      if (fscanf(calls, "%63s", name) != 1) { fprintf(stderr, "missing argument %d of %s\n", i, fname); return 1; }
      if (!strcmp(name, "=f") && fscanf(calls, "%lf", &args[i].v_float64) == 1) {
        args[i].type_index = kTVMFFIFloat;
      } else if (!strcmp(name, "=i") && fscanf(calls, "%ld", &args[i].v_int64) == 1) {
        args[i].type_index = kTVMFFIInt;
      } else {
        Tensor *t = name[0] == '=' ? NULL : tensor(argv[2], name, calls);
        if (!t) { fprintf(stderr, "bad argument line for %s argument %d\n", fname, i); return 1; }
        args[i].type_index = kTVMFFIDLTensorPtr;
        args[i].v_ptr = &t->t;
      }
    }
    char sym[160];
    snprintf(sym, sizeof(sym), "__tvm_ffi_%s", fname);
    TVMFFISafeCallType f = (TVMFFISafeCallType)dlsym(lib, sym);
    if (!f) { fprintf(stderr, "no function %s in %s\n", fname, argv[1]); return 1; }
    TVMFFIAny result;
    memset(&result, 0, sizeof(result));
    if (f(NULL, args, nargs, &result) != 0) return 2;
  }
  fclose(calls);
  for (int i = 0; i < num_tensors; i++) {
    snprintf(path, sizeof(path), "%s/%s.out", argv[2], tensors[i].name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(tensors[i].t.data, 1, tensors[i].nbytes, f) != tensors[i].nbytes) { perror(path); return 1; }
    fclose(f);
  }
  return 0;
}
