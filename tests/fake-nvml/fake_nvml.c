/*
 * A fake libnvidia-ml.so.1 for baleen's tests: the real NVML backend (nvml-wrapper) loads it by
 * path and sees the GPUs of a topology file instead of real hardware.
 *
 * Build:  cc -shared -fPIC -o libnvidia-ml.so.1 fake_nvml.c -ldl
 *
 * It implements, with the signatures and struct layouts of nvml.h (as nvml-wrapper-sys 0.10 binds
 * them), what nvml-wrapper calls on init and drop (nvmlInit_v2, nvmlSystemGetDriverVersion,
 * nvmlShutdown) and every call baleen's backend makes, plus a few neighbours (nvmlInitWithFlags,
 * nvmlErrorString, nvmlSystemGetNVMLVersion, nvmlDeviceGetIndex, nvmlDeviceGetMemoryInfo,
 * nvmlDeviceIsMigDeviceHandle, nvmlDeviceGetDeviceHandleFromMigDeviceHandle). nvml-wrapper
 * resolves symbols one by one and keeps a missing one as an error for when it is called, so
 * anything else is simply absent.
 *
 * The topology file is $BALEEN_FAKE_NVML_TOPOLOGY, or fake-nvml-topology.txt beside this library
 * (tests copy the library into a temp dir of their own, so that they need no environment). It is
 * read by the first nvmlInit_v2. One directive per line, fields separated by spaces, '#' starts a
 * comment:
 *
 *   driver <version>
 *   gpu <index> <uuid> <memory bytes> <pci bus id> <name, rest of the line>
 *   mig_mode <gpu index> <0|1>
 *   cuda_cc <gpu index> <major> <minor>        (nvmlDeviceGetCudaComputeCapability; without
 *       it the call answers NVML_ERROR_NOT_SUPPORTED)
 *   mig <gpu index> <uuid> <memory bytes> <gpu instance id> <compute instance id>
 *       <gpu-instance slices> <compute-instance slices> <memory MiB>      (one line)
 *   nvlink <gpu index> <gpu index>
 *   fail <nvml function> <gpu index or *> <nvml return code>
 *
 * GPU indices must be 0..N-1. MIG devices fill slots 0.. of their GPU in file order; the GPU
 * reports 7 slots, the rest empty (NVML_ERROR_NOT_FOUND), as an A100 does. `nvlink a b` makes
 * nvmlDeviceGetP2PStatus(NVLINK) answer OK between a and b, both ways; other pairs answer
 * NVML_P2P_STATUS_NOT_SUPPORTED. `fail` makes a function return the code for that GPU (for MIG
 * handles, their parent GPU), e.g. `fail nvmlDeviceGetP2PStatus * 3` for NOT_SUPPORTED.
 *
 * Health events: $BALEEN_FAKE_NVML_EVENTS, or fake-nvml-events.txt beside the library, holds lines
 * `xid <gpu index> <xid>`. Each event set reads the file from its start; nvmlEventSetWait_v2
 * delivers the next complete line whose GPU is registered for XID events (others are skipped),
 * polling the file until the timeout. Tests append lines to inject events.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

/* ---- nvml.h subset (layouts as in nvml-wrapper-sys 0.10's bindings) ------------------------ */

typedef unsigned int nvmlReturn_t;
#define NVML_SUCCESS 0u
#define NVML_ERROR_UNINITIALIZED 1u
#define NVML_ERROR_INVALID_ARGUMENT 2u
#define NVML_ERROR_NOT_SUPPORTED 3u
#define NVML_ERROR_NOT_FOUND 6u
#define NVML_ERROR_INSUFFICIENT_SIZE 7u
#define NVML_ERROR_DRIVER_NOT_LOADED 9u
#define NVML_ERROR_TIMEOUT 10u
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25u
#define NVML_ERROR_UNKNOWN 999u

#define NVML_P2P_CAPS_INDEX_NVLINK 2u
#define NVML_P2P_STATUS_OK 0u
#define NVML_P2P_STATUS_NOT_SUPPORTED 5u

#define nvmlEventTypeSingleBitEccError 0x1ull
#define nvmlEventTypeDoubleBitEccError 0x2ull
#define nvmlEventTypePState 0x4ull
#define nvmlEventTypeXidCriticalError 0x8ull
#define nvmlEventTypeClock 0x10ull

struct nvmlDevice_st {
    int gpu; /* index of the physical GPU */
    int mig; /* slot of the MIG device on it, or -1 for the GPU itself */
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    unsigned int gpuInstanceSliceCount;
    unsigned int computeInstanceSliceCount;
    unsigned long long memorySizeMB;
} nvmlDeviceAttributes_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define MAX_GPUS 64
#define MAX_MIG 16
#define MIG_SLOTS 7
#define MAX_FAILS 64
#define NAME_LEN 96
#define UUID_LEN 96
#define BUS_ID_LEN 32

struct nvmlEventSet_st {
    unsigned long long registered[MAX_GPUS];
    long offset; /* bytes of the events file already consumed */
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

/* nvmlProcessInfo_v2_t (nvml.h), what nvmlDeviceGetComputeRunningProcesses_v3 fills. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* ---- state ----------------------------------------------------------------------------------- */

struct fake_mig {
    char uuid[UUID_LEN];
    unsigned long long memory;
    unsigned int gpu_instance_id, compute_instance_id;
    unsigned int gpu_slices, compute_slices;
    unsigned long long memory_mib;
};

struct fake_gpu {
    int present;
    char uuid[UUID_LEN];
    char name[NAME_LEN];
    char bus_id[BUS_ID_LEN];
    unsigned long long memory;
    unsigned int mig_mode;
    int cc_major, cc_minor; /* -1: not supported */
    int mig_count;
    struct fake_mig mig[MAX_MIG];
    int nvlink[MAX_GPUS];
};

struct fake_fail {
    char function[64];
    int gpu; /* -1: any */
    nvmlReturn_t code;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static char driver_version[80];
static int gpu_count;
static struct fake_gpu gpus[MAX_GPUS];
static struct nvmlDevice_st gpu_handles[MAX_GPUS];
static struct nvmlDevice_st mig_handles[MAX_GPUS][MAX_MIG];
static struct fake_fail fails[MAX_FAILS];
static int fail_count;

/* The file `name` beside this library, or the path in environment variable `env`. */
static int data_file(const char *env, const char *name, char *out, size_t size) {
    const char *from_env = getenv(env);
    if (from_env != NULL && from_env[0] != '\0') {
        return snprintf(out, size, "%s", from_env) < (int)size ? 0 : -1;
    }
    Dl_info info;
    if (dladdr((void *)&data_file, &info) == 0 || info.dli_fname == NULL) {
        return -1;
    }
    char self[PATH_MAX];
    snprintf(self, sizeof self, "%s", info.dli_fname);
    return snprintf(out, size, "%s/%s", dirname(self), name) < (int)size ? 0 : -1;
}

static void reset_state(void) {
    driver_version[0] = '\0';
    gpu_count = 0;
    fail_count = 0;
    memset(gpus, 0, sizeof gpus);
    for (int g = 0; g < MAX_GPUS; g++) {
        gpu_handles[g].gpu = g;
        gpu_handles[g].mig = -1;
        for (int m = 0; m < MAX_MIG; m++) {
            mig_handles[g][m].gpu = g;
            mig_handles[g][m].mig = m;
        }
    }
}

static int valid_gpu_index(long index) { return index >= 0 && index < MAX_GPUS; }

/* Parses the topology file; on error prints why to stderr and returns -1. */
static int load_topology(void) {
    char path[PATH_MAX];
    if (data_file("BALEEN_FAKE_NVML_TOPOLOGY", "fake-nvml-topology.txt", path, sizeof path) != 0) {
        fprintf(stderr, "fake NVML: cannot locate the topology file\n");
        return -1;
    }
    FILE *file = fopen(path, "r");
    if (file == NULL) {
        fprintf(stderr, "fake NVML: cannot open topology file %s: %s\n", path, strerror(errno));
        return -1;
    }
    reset_state();
    char line[1024];
    int number = 0;
    int ok = 0;
    while (fgets(line, sizeof line, file) != NULL) {
        number++;
        char *hash = strchr(line, '#');
        if (hash != NULL) *hash = '\0';
        line[strcspn(line, "\r\n")] = '\0';
        char word[32];
        int used = 0;
        if (sscanf(line, " %31s%n", word, &used) != 1) continue; /* blank line */
        const char *rest = line + used;
        if (strcmp(word, "driver") == 0) {
            ok = sscanf(rest, " %79s", driver_version) == 1;
        } else if (strcmp(word, "gpu") == 0) {
            long index;
            char uuid[UUID_LEN], bus[BUS_ID_LEN];
            unsigned long long memory;
            int name_at = 0;
            ok = sscanf(rest, " %ld %95s %llu %31s %n", &index, uuid, &memory, bus, &name_at) == 4 &&
                 name_at > 0 && valid_gpu_index(index) && rest[name_at] != '\0';
            if (ok) {
                struct fake_gpu *gpu = &gpus[index];
                gpu->present = 1;
                snprintf(gpu->uuid, sizeof gpu->uuid, "%s", uuid);
                snprintf(gpu->bus_id, sizeof gpu->bus_id, "%s", bus);
                snprintf(gpu->name, sizeof gpu->name, "%s", rest + name_at);
                gpu->memory = memory;
                gpu->cc_major = gpu->cc_minor = -1; /* until a cuda_cc line says */
                if (index + 1 > gpu_count) gpu_count = (int)index + 1;
            }
        } else if (strcmp(word, "cuda_cc") == 0) {
            long index;
            int major, minor;
            ok = sscanf(rest, " %ld %d %d", &index, &major, &minor) == 3 && valid_gpu_index(index) &&
                 major >= 0 && minor >= 0;
            if (ok) {
                gpus[index].cc_major = major;
                gpus[index].cc_minor = minor;
            }
        } else if (strcmp(word, "mig_mode") == 0) {
            long index;
            unsigned int mode;
            ok = sscanf(rest, " %ld %u", &index, &mode) == 2 && valid_gpu_index(index) && mode <= 1;
            if (ok) gpus[index].mig_mode = mode;
        } else if (strcmp(word, "mig") == 0) {
            long index;
            struct fake_mig mig;
            ok = sscanf(rest, " %ld %95s %llu %u %u %u %u %llu", &index, mig.uuid, &mig.memory,
                        &mig.gpu_instance_id, &mig.compute_instance_id, &mig.gpu_slices,
                        &mig.compute_slices, &mig.memory_mib) == 8 &&
                 valid_gpu_index(index) && gpus[index].mig_count < MAX_MIG;
            if (ok) gpus[index].mig[gpus[index].mig_count++] = mig;
        } else if (strcmp(word, "nvlink") == 0) {
            long a, b;
            ok = sscanf(rest, " %ld %ld", &a, &b) == 2 && valid_gpu_index(a) && valid_gpu_index(b);
            if (ok) {
                gpus[a].nvlink[b] = 1;
                gpus[b].nvlink[a] = 1;
            }
        } else if (strcmp(word, "fail") == 0) {
            char gpu[16];
            struct fake_fail fail;
            ok = fail_count < MAX_FAILS &&
                 sscanf(rest, " %63s %15s %u", fail.function, gpu, &fail.code) == 3;
            if (ok) {
                fail.gpu = strcmp(gpu, "*") == 0 ? -1 : atoi(gpu);
                fails[fail_count++] = fail;
            }
        } else {
            ok = 0;
        }
        if (!ok) {
            fprintf(stderr, "fake NVML: %s:%d: cannot parse `%s`\n", path, number, line);
            fclose(file);
            return -1;
        }
    }
    fclose(file);
    for (int g = 0; g < gpu_count; g++) {
        if (!gpus[g].present) {
            fprintf(stderr, "fake NVML: %s: no `gpu %d` line (indices must be 0..N-1)\n", path, g);
            return -1;
        }
    }
    return 0;
}

/* Faults set while the library runs, read again at every call from the faults file beside the
 * library (or $BALEEN_FAKE_NVML_FAULTS): `fail <function> <gpu index or *> <code>` makes the
 * call return the code, `hang <function> <gpu index or *> <milliseconds>` makes it sleep first
 * (a GPU whose calls hang). The file replaced or removed takes effect at the next call. */
static nvmlReturn_t runtime_fault(const char *function, int gpu) {
    char path[PATH_MAX];
    if (data_file("BALEEN_FAKE_NVML_FAULTS", "fake-nvml-faults.txt", path, sizeof path) != 0) {
        return NVML_SUCCESS;
    }
    FILE *file = fopen(path, "r");
    if (file == NULL) return NVML_SUCCESS;
    char line[256];
    nvmlReturn_t code = NVML_SUCCESS;
    while (code == NVML_SUCCESS && fgets(line, sizeof line, file) != NULL) {
        char kind[16], name[64], which[16];
        unsigned int value;
        if (sscanf(line, " %15s %63s %15s %u", kind, name, which, &value) != 4) continue;
        if (strcmp(name, function) != 0) continue;
        if (strcmp(which, "*") != 0 && atoi(which) != gpu) continue;
        if (strcmp(kind, "fail") == 0) {
            code = (nvmlReturn_t)value;
        } else if (strcmp(kind, "hang") == 0) {
            usleep(value * 1000);
        }
    }
    fclose(file);
    return code;
}

/* The code a `fail` directive (or a runtime fault) sets for this function and GPU, or
 * NVML_SUCCESS. */
static nvmlReturn_t injected(const char *function, int gpu) {
    for (int i = 0; i < fail_count; i++) {
        if (strcmp(fails[i].function, function) == 0 && (fails[i].gpu == -1 || fails[i].gpu == gpu)) {
            return fails[i].code;
        }
    }
    return runtime_fault(function, gpu);
}

static int is_gpu_handle(nvmlDevice_t device) {
    return device != NULL && device >= &gpu_handles[0] && device < &gpu_handles[gpu_count];
}

static int is_mig_handle(nvmlDevice_t device) {
    if (device == NULL || device < &mig_handles[0][0] || device >= &mig_handles[MAX_GPUS][0]) {
        return 0;
    }
    return device->gpu < gpu_count && device->mig < gpus[device->gpu].mig_count;
}

static struct fake_mig *mig_of(nvmlDevice_t device) { return &gpus[device->gpu].mig[device->mig]; }

static nvmlReturn_t copy_string(char *out, unsigned int length, const char *value) {
    if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* Common checks: initialised, a known handle (GPU, or MIG when allowed), no injected failure. */
#define CHECK_DEVICE(function, device, allow_mig)                                                 \
    do {                                                                                           \
        if (init_count == 0) return NVML_ERROR_UNINITIALIZED;                                      \
        if (!is_gpu_handle(device) && !((allow_mig) && is_mig_handle(device)))                     \
            return NVML_ERROR_INVALID_ARGUMENT;                                                    \
        nvmlReturn_t failure = injected(function, (device)->gpu);                                  \
        if (failure != NVML_SUCCESS) return failure;                                               \
    } while (0)

/* ---- init and system ------------------------------------------------------------------------- */

nvmlReturn_t nvmlInit_v2(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t result = NVML_SUCCESS;
    if (init_count == 0 && load_topology() != 0) {
        result = NVML_ERROR_DRIVER_NOT_LOADED;
    } else {
        init_count++;
    }
    pthread_mutex_unlock(&lock);
    return result;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return nvmlInit_v2();
}

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t result = NVML_SUCCESS;
    if (init_count == 0) {
        result = NVML_ERROR_UNINITIALIZED;
    } else {
        init_count--;
    }
    pthread_mutex_unlock(&lock);
    return result;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t failure = injected("nvmlSystemGetDriverVersion", -1);
    if (failure != NVML_SUCCESS) return failure;
    if (driver_version[0] == '\0') return NVML_ERROR_NOT_SUPPORTED;
    return copy_string(version, length, driver_version);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, "12.0-baleen-fake");
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t failure = injected("nvmlDeviceGetCount_v2", -1);
    if (failure != NVML_SUCCESS) return failure;
    *count = (unsigned int)gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= (unsigned int)gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t failure = injected("nvmlDeviceGetHandleByIndex_v2", (int)index);
    if (failure != NVML_SUCCESS) return failure;
    *device = &gpu_handles[index];
    return NVML_SUCCESS;
}

/* ---- device queries -------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    CHECK_DEVICE("nvmlDeviceGetIndex", device, 0);
    if (index == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *index = (unsigned int)device->gpu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    CHECK_DEVICE("nvmlDeviceGetUUID", device, 1);
    const char *value = is_mig_handle(device) ? mig_of(device)->uuid : gpus[device->gpu].uuid;
    return copy_string(uuid, length, value);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    CHECK_DEVICE("nvmlDeviceGetName", device, 1);
    return copy_string(name, length, gpus[device->gpu].name);
}

/* A GPU's live readings, from the telemetry file (`telemetry <gpu> <used bytes> <gpu %>
 * <memory %> <celsius> <milliwatts>` lines, BALEEN_FAKE_NVML_TELEMETRY or
 * fake-nvml-telemetry.txt beside the library), read at every call. */
struct fake_telemetry {
    unsigned long long used;
    unsigned int util_gpu, util_memory, celsius, milliwatts;
};

static int telemetry_of(int gpu, struct fake_telemetry *out) {
    char path[PATH_MAX];
    if (data_file("BALEEN_FAKE_NVML_TELEMETRY", "fake-nvml-telemetry.txt", path, sizeof path) != 0) {
        return 0;
    }
    FILE *file = fopen(path, "r");
    if (file == NULL) return 0;
    int found = 0;
    char line[256];
    while (!found && fgets(line, sizeof line, file) != NULL) {
        long index;
        struct fake_telemetry t;
        if (sscanf(line, " telemetry %ld %llu %u %u %u %u", &index, &t.used, &t.util_gpu,
                   &t.util_memory, &t.celsius, &t.milliwatts) == 6 && index == gpu) {
            *out = t;
            found = 1;
        }
    }
    fclose(file);
    return found;
}

static unsigned long long memory_of(nvmlDevice_t device) {
    return is_mig_handle(device) ? mig_of(device)->memory : gpus[device->gpu].memory;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    CHECK_DEVICE("nvmlDeviceGetMemoryInfo", device, 1);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memory->total = memory_of(device);
    memory->free = memory->total;
    memory->used = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    CHECK_DEVICE("nvmlDeviceGetMemoryInfo_v2", device, 1);
    if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = memory_of(device);
    memory->reserved = 0;
    struct fake_telemetry t;
    memory->used = (!is_mig_handle(device) && telemetry_of(device->gpu, &t)) ? t.used : 0;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    CHECK_DEVICE("nvmlDeviceGetPciInfo_v3", device, 0);
    if (pci == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    const char *bus_id = gpus[device->gpu].bus_id;
    unsigned int function = 0;
    if (sscanf(bus_id, "%x:%x:%x.%x", &pci->domain, &pci->bus, &pci->device, &function) != 4) {
        return NVML_ERROR_UNKNOWN;
    }
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.%X", pci->domain & 0xffff,
             pci->bus, pci->device, function);
    pci->pciDeviceId = 0x233510DEu; /* a fixed NVIDIA device ID; baleen does not read it */
    pci->pciSubSystemId = 0x18BE10DEu;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetP2PStatus(nvmlDevice_t device1, nvmlDevice_t device2,
                                    unsigned int p2pIndex, unsigned int *p2pStatus) {
    CHECK_DEVICE("nvmlDeviceGetP2PStatus", device1, 0);
    if (!is_gpu_handle(device2) || p2pStatus == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (p2pIndex != NVML_P2P_CAPS_INDEX_NVLINK) {
        *p2pStatus = NVML_P2P_STATUS_NOT_SUPPORTED;
        return NVML_SUCCESS;
    }
    int linked = device1 != device2 && gpus[device1->gpu].nvlink[device2->gpu];
    *p2pStatus = linked ? NVML_P2P_STATUS_OK : NVML_P2P_STATUS_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    CHECK_DEVICE("nvmlDeviceGetCudaComputeCapability", device, 0);
    if (major == NULL || minor == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpus[device->gpu].cc_major < 0) return NVML_ERROR_NOT_SUPPORTED;
    *major = gpus[device->gpu].cc_major;
    *minor = gpus[device->gpu].cc_minor;
    return NVML_SUCCESS;
}

/* ---- MIG ------------------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode,
                                  unsigned int *pendingMode) {
    CHECK_DEVICE("nvmlDeviceGetMigMode", device, 0);
    if (currentMode == NULL || pendingMode == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *currentMode = gpus[device->gpu].mig_mode;
    *pendingMode = gpus[device->gpu].mig_mode;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    CHECK_DEVICE("nvmlDeviceGetMaxMigDeviceCount", device, 0);
    if (count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    int slots = gpus[device->gpu].mig_count > MIG_SLOTS ? gpus[device->gpu].mig_count : MIG_SLOTS;
    *count = gpus[device->gpu].mig_mode ? (unsigned int)slots : 0u;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *migDevice) {
    CHECK_DEVICE("nvmlDeviceGetMigDeviceHandleByIndex", device, 0);
    if (migDevice == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!gpus[device->gpu].mig_mode) return NVML_ERROR_NOT_SUPPORTED;
    if (index >= (unsigned int)gpus[device->gpu].mig_count) return NVML_ERROR_NOT_FOUND;
    *migDevice = &mig_handles[device->gpu][index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    CHECK_DEVICE("nvmlDeviceIsMigDeviceHandle", device, 1);
    if (isMigDevice == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *isMigDevice = is_mig_handle(device) ? 1u : 0u;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice,
                                                          nvmlDevice_t *device) {
    CHECK_DEVICE("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice, 1);
    if (device == NULL || !is_mig_handle(migDevice)) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpu_handles[migDevice->gpu];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetAttributes_v2(nvmlDevice_t device, nvmlDeviceAttributes_t *attributes) {
    CHECK_DEVICE("nvmlDeviceGetAttributes_v2", device, 1);
    if (attributes == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if (!is_mig_handle(device)) return NVML_ERROR_NOT_SUPPORTED;
    const struct fake_mig *mig = mig_of(device);
    memset(attributes, 0, sizeof *attributes);
    attributes->multiprocessorCount = 14u * mig->compute_slices;
    attributes->gpuInstanceSliceCount = mig->gpu_slices;
    attributes->computeInstanceSliceCount = mig->compute_slices;
    attributes->memorySizeMB = mig->memory_mib;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    CHECK_DEVICE("nvmlDeviceGetGpuInstanceId", device, 1);
    if (id == NULL || !is_mig_handle(device)) return NVML_ERROR_INVALID_ARGUMENT;
    *id = mig_of(device)->gpu_instance_id;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    CHECK_DEVICE("nvmlDeviceGetComputeInstanceId", device, 1);
    if (id == NULL || !is_mig_handle(device)) return NVML_ERROR_INVALID_ARGUMENT;
    *id = mig_of(device)->compute_instance_id;
    return NVML_SUCCESS;
}

/* ---- events ---------------------------------------------------------------------------------- */

#define SUPPORTED_EVENTS                                                                           \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState |       \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    CHECK_DEVICE("nvmlDeviceGetSupportedEventTypes", device, 0);
    if (eventTypes == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t failure = injected("nvmlEventSetCreate", -1);
    if (failure != NVML_SUCCESS) return failure;
    *set = calloc(1, sizeof **set);
    if (*set == NULL) return NVML_ERROR_UNKNOWN;
    /* Like NVML, a new set sees only events that happen after it exists: skip what the events
       file already holds. */
    char path[PATH_MAX];
    if (data_file("BALEEN_FAKE_NVML_EVENTS", "fake-nvml-events.txt", path, sizeof path) == 0) {
        FILE *file = fopen(path, "r");
        if (file != NULL) {
            if (fseek(file, 0, SEEK_END) == 0) {
                long end = ftell(file);
                (*set)->offset = end > 0 ? end : 0;
            }
            fclose(file);
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set) {
    CHECK_DEVICE("nvmlDeviceRegisterEvents", device, 0);
    if (set == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    if ((eventTypes & ~SUPPORTED_EVENTS) != 0) return NVML_ERROR_NOT_SUPPORTED;
    set->registered[device->gpu] |= eventTypes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    free(set);
    return NVML_SUCCESS;
}

/* Reads the next complete event line after `set->offset` for a registered GPU; 1 if found. */
static int next_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    char path[PATH_MAX];
    if (data_file("BALEEN_FAKE_NVML_EVENTS", "fake-nvml-events.txt", path, sizeof path) != 0) {
        return 0;
    }
    FILE *file = fopen(path, "r");
    if (file == NULL) return 0;
    int found = 0;
    char line[256];
    if (fseek(file, set->offset, SEEK_SET) == 0) {
        while (!found && fgets(line, sizeof line, file) != NULL) {
            size_t length = strlen(line);
            if (length == 0 || line[length - 1] != '\n') break; /* still being written */
            set->offset += (long)length;
            long gpu;
            unsigned long long xid;
            if (sscanf(line, " xid %ld %llu", &gpu, &xid) != 2 || gpu < 0 || gpu >= gpu_count) {
                continue;
            }
            if ((set->registered[gpu] & nvmlEventTypeXidCriticalError) == 0) continue;
            data->device = &gpu_handles[gpu];
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = xid;
            data->gpuInstanceId = 0xFFFFFFFFu;
            data->computeInstanceId = 0xFFFFFFFFu;
            found = 1;
        }
    }
    fclose(file);
    return found;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1000.0 + (double)ts.tv_nsec / 1e6;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (set == NULL || data == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t failure = injected("nvmlEventSetWait_v2", -1);
    if (failure != NVML_SUCCESS) return failure;
    double deadline = now_ms() + (double)timeoutms;
    for (;;) {
        if (next_event(set, data)) return NVML_SUCCESS;
        double left = deadline - now_ms();
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        /* Poll the events file every 5 ms (NVML itself waits on the driver). */
        struct timespec pause = {0, (long)((left < 5.0 ? left : 5.0) * 1e6)};
        nanosleep(&pause, NULL);
    }
}

/* The compute processes of a GPU, read at every call from the processes file
 * (`process <gpu index> <pid> <bytes>` lines, BALEEN_FAKE_NVML_PROCESSES or
 * fake-nvml-processes.txt beside the library), as NVML lists them: a count query with a null
 * buffer answers INSUFFICIENT_SIZE and the count, a buffer too small likewise. */
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_t *infos) {
    CHECK_DEVICE("nvmlDeviceGetComputeRunningProcesses_v3", device, 0);
    if (infoCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlProcessInfo_t found[64];
    unsigned int count = 0;
    char path[PATH_MAX];
    if (data_file("BALEEN_FAKE_NVML_PROCESSES", "fake-nvml-processes.txt", path, sizeof path) == 0) {
        FILE *file = fopen(path, "r");
        if (file != NULL) {
            char line[256];
            while (count < 64 && fgets(line, sizeof line, file) != NULL) {
                long gpu;
                unsigned int pid;
                unsigned long long bytes;
                if (sscanf(line, " process %ld %u %llu", &gpu, &pid, &bytes) != 3) continue;
                if (gpu != device->gpu) continue;
                found[count].pid = pid;
                found[count].usedGpuMemory = bytes;
                found[count].gpuInstanceId = 0xFFFFFFFFu;
                found[count].computeInstanceId = 0xFFFFFFFFu;
                count++;
            }
            fclose(file);
        }
    }
    if (infos == NULL || *infoCount < count) {
        *infoCount = count;
        return count == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    memcpy(infos, found, count * sizeof *infos);
    *infoCount = count;
    return NVML_SUCCESS;
}

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* Utilisation, temperature and power: from the telemetry file; NOT_SUPPORTED for a GPU it does
 * not list (as NVML answers on GPUs without the sensor). */
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    CHECK_DEVICE("nvmlDeviceGetUtilizationRates", device, 0);
    if (utilization == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_telemetry t;
    if (!telemetry_of(device->gpu, &t)) return NVML_ERROR_NOT_SUPPORTED;
    utilization->gpu = t.util_gpu;
    utilization->memory = t.util_memory;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *celsius) {
    CHECK_DEVICE("nvmlDeviceGetTemperature", device, 0);
    if (celsius == NULL || sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_telemetry t;
    if (!telemetry_of(device->gpu, &t)) return NVML_ERROR_NOT_SUPPORTED;
    *celsius = t.celsius;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *milliwatts) {
    CHECK_DEVICE("nvmlDeviceGetPowerUsage", device, 0);
    if (milliwatts == NULL) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_telemetry t;
    if (!telemetry_of(device->gpu, &t)) return NVML_ERROR_NOT_SUPPORTED;
    *milliwatts = t.milliwatts;
    return NVML_SUCCESS;
}
