/* A stand-in for libcupti's activity API, for tests of kernels::profile::cupti without a GPU.
 * `fake_run(n)` "runs" n kernels; the next cuptiActivityFlushAll writes their records (and
 * one non-kernel record) into a buffer the client supplies and hands it back. `fake_mode`
 * makes it misbehave the ways a real library could: records running past the valid bytes, a
 * truncated kernel record, dropped records, an error from the iteration, a buffer the client
 * never supplied (another client's), an iteration that hands the same record again. Kernel
 * records are CUpti_ActivityKernel10-sized (216 bytes) with the name pointer at offset 104:
 * kernel i is "gemm", "softmax" or unnamed (null) as i % 3 is 0, 1 or 2. cuptiGetVersion
 * answers $FAKE_CUPTI_VERSION, else 130001 (CUDA 13.0 update 1). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*req_t)(uint8_t **, size_t *, size_t *);
typedef void (*done_t)(void *, uint32_t, uint8_t *, size_t, size_t);

enum { REC = 216, MODE_OK = 0, MODE_PAST_END = 1, MODE_TRUNCATED = 2, MODE_DROPPED = 3, MODE_ERROR = 4,
       MODE_FOREIGN = 5, MODE_STUCK = 6 };
static uint64_t foreign[(8 * REC) / 8];

static req_t req;
static done_t done;
static int enabled;
static int pending;
static int mode;
static uint64_t clock_ns = 1000;
static const char *names[3] = {"gemm", "softmax", NULL};

int cuptiGetVersion(uint32_t *version) {
    const char *v = getenv("FAKE_CUPTI_VERSION");
    *version = v ? (uint32_t)strtoul(v, NULL, 10) : 130001u;
    return 0;
}

void fake_run(int n) { if (enabled) pending += n; }
void fake_mode(int m) { mode = m; }
int fake_enabled(void) { return enabled; }

int cuptiActivityRegisterCallbacks(req_t r, done_t d) { req = r; done = d; return 0; }
int cuptiActivityEnable(uint32_t kind) { if (kind != 10) return 21; enabled = 1; return 0; }
int cuptiActivityDisable(uint32_t kind) { (void)kind; enabled = 0; return 0; }

static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

int cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    if (!req || !done || pending == 0) return 0;
    uint8_t *buf = NULL;
    size_t size = 0, max = 0;
    if (mode == MODE_FOREIGN) { /* a buffer of its own, as another client's would be */
        buf = (uint8_t *)foreign;
        size = sizeof foreign;
        if ((size_t)(pending + 1) * REC > size) pending = (int)(size / REC) - 1;
    } else {
        req(&buf, &size, &max);
    }
    if (!buf || size < (size_t)(pending + 1) * REC) return 1;
    memset(buf, 0, (size_t)(pending + 1) * REC);
    size_t valid = 0;
    /* One memcpy record (kind 1) first: not a kernel. */
    put_u32(buf, 1);
    valid += REC;
    for (int i = 0; i < pending; i++) {
        uint8_t *r = buf + valid;
        put_u32(r, 10);
        put_u64(r + 16, clock_ns);
        put_u64(r + 24, clock_ns + 250); /* every kernel 250 ns */
        memcpy(r + 104, &names[i % 3], sizeof(const char *));
        clock_ns += 1000;
        valid += REC;
    }
    if (mode == MODE_TRUNCATED) valid -= REC - 20; /* the last kernel record cut to 20 bytes */
    pending = 0;
    done(NULL, 0, buf, size, valid);
    return 0;
}

int cuptiActivityGetNextRecord(uint8_t *buf, size_t valid, uint8_t **rec) {
    uint8_t *next = *rec ? *rec + REC : buf;
    if (mode == MODE_ERROR && *rec) return 7;
    if (mode == MODE_PAST_END && *rec) { /* claims a record past the valid bytes */
        *rec = buf + valid + REC;
        return 0;
    }
    if (mode == MODE_STUCK && *rec) { *rec = buf; return 0; } /* the first record again */
    if (next >= buf + valid) return 12;
    *rec = next;
    return 0;
}

int cuptiActivityGetNumDroppedRecords(void *ctx, uint32_t stream, size_t *dropped) {
    (void)ctx; (void)stream;
    *dropped = mode == MODE_DROPPED ? 5 : 0;
    return 0;
}
