/* fs_adam_table.h — what one launch of the multi-parameter Adam kernel (fsc_fs_adam_multi in
 * csrc/cuda/fs_adam.cu, launched by fsc_gpu_fs_adam_multi in csrc/gpu/launchers.c) takes by value: up
 * to FSC_FS_ADAM_TABLE parameters of one dtype combination, each cut into chunks of
 * FSC_FS_ADAM_CHUNK elements, one thread block per chunk. Plain C, shared by gcc and nvcc. */
#ifndef FSC_FS_ADAM_TABLE_H
#define FSC_FS_ADAM_TABLE_H

#define FSC_FS_ADAM_TABLE 24   /* parameters per launch: the table stays well under 4 KiB */
#define FSC_FS_ADAM_CHUNK 4096 /* elements per thread block */

typedef struct {
    void *param[FSC_FS_ADAM_TABLE];
    const void *grad[FSC_FS_ADAM_TABLE];
    void *exp_avg[FSC_FS_ADAM_TABLE];
    void *exp_avg_sq[FSC_FS_ADAM_TABLE];
    void *copy[FSC_FS_ADAM_TABLE]; /* NULL: no half copy to write */
    long long numel[FSC_FS_ADAM_TABLE];
    float step_size[FSC_FS_ADAM_TABLE];     /* each parameter's, from its own step count */
    int first_block[FSC_FS_ADAM_TABLE + 1]; /* parameter i's chunks are blocks [first_block[i], first_block[i+1]) */
    int count;                              /* parameters in the table */
} fsc_fs_adam_table_t;

#endif /* FSC_FS_ADAM_TABLE_H */
