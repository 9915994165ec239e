/*
 * A QEMU TCG plugin (qemu-aarch64 7.2 and later: plugin API version 1) that counts executed guest instructions
 * exactly: each translation block gets a counter that an inline add bumps every time the block runs, and at exit
 * every block's start address, instruction count and execution count go to the file given as out=PATH, one block
 * a line ("vaddr insns executions", hexadecimal address). Blocks translated twice (after a flush) appear twice;
 * summing insns x executions by address range splits the total by library or function.
 *
 *   cc -shared -fPIC -O2 -o count_insns.so count_insns.c
 *   qemu-aarch64 -plugin ./count_insns.so,out=counts.txt PROGRAM ...
 *
 * The counters are plain adds, not atomic: exact for one guest thread, close for several.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the few declarations of QEMU's include/qemu/qemu-plugin.h (API version 1) this plugin uses */
typedef uint64_t qemu_plugin_id_t;
typedef struct {
    const char *target_name;
    struct { int min; int cur; } version;
    bool system_emulation;
    union { struct { int smp_vcpus; int max_vcpus; } system; };
} qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1;

struct block { uint64_t vaddr, insns, executions; };
enum { CHUNK = 1 << 16 };
struct chunk { struct block blocks[CHUNK]; size_t used; struct chunk *next; };  /* never moved: counters stay put */

static struct chunk *first, *last;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char *out_path;

static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    pthread_mutex_lock(&lock);
    if (!last || last->used == CHUNK) {
        struct chunk *c = calloc(1, sizeof *c);
        if (!c) { pthread_mutex_unlock(&lock); return; }
        if (last) last->next = c; else first = c;
        last = c;
    }
    struct block *b = &last->blocks[last->used++];
    pthread_mutex_unlock(&lock);
    b->vaddr = qemu_plugin_tb_vaddr(tb);
    b->insns = qemu_plugin_tb_n_insns(tb);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &b->executions, 1);
}

static void finished(qemu_plugin_id_t id, void *unused)
{
    FILE *f = fopen(out_path, "w");
    if (!f) { perror(out_path); return; }
    for (struct chunk *c = first; c; c = c->next)
        for (size_t i = 0; i < c->used; i++)
            if (c->blocks[i].executions)
                fprintf(f, "%" PRIx64 " %" PRIu64 " %" PRIu64 "\n", c->blocks[i].vaddr, c->blocks[i].insns,
                        c->blocks[i].executions);
    fclose(f);
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv)
{
    for (int i = 0; i < argc; i++)
        if (!strncmp(argv[i], "out=", 4)) out_path = argv[i] + 4;
    if (!out_path) { fprintf(stderr, "count_insns: give out=PATH\n"); return 1; }
    qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
    qemu_plugin_register_atexit_cb(id, finished, NULL);
    return 0;
}
