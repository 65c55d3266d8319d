/* shm_direct.h — collectives that read the peers' buffers straight from their memory
 * (process_vm_readv) instead of passing the data through the segment's slots. */
#ifndef FSC_SHM_DIRECT_H
#define FSC_SHM_DIRECT_H

#include "comm/shm_internal.h"

/* 1 when op `a` runs direct on this group: the group agreed on direct reads at join and the op's
 * sizes fall in the window (shm_direct.c). Depends only on the group and the op's header, so
 * every rank of the op decides alike. */
int fsc_shm_direct_fits(const fsc_shm_group_t *g, const fsc_shm_args_t *a);

/* Run a collective that fits (above) to completion on the calling thread. */
fsc_status_t fsc_shm_direct_run(fsc_shm_group_t *g, const fsc_shm_args_t *a);

#endif /* FSC_SHM_DIRECT_H */
